"""What a request may ask and the plan it becomes, above `contract/`: `service_settings` (the
FADRM_* settings), `limits` (the ceilings of one request), `catalog` (the operator's datasets and
teachers), `requests` (a request checked against them and built into the job its driver runs)."""

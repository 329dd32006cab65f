"""The REST service under a hostile client: one command, a subcommand per class of probe, each on
a `fadrm serve` of its own on loopback (its own store and local Ray head, a small digits teacher).

    python -m bench.api_probes limits [--out DIR] [--json]
    python -m bench.api_probes floods [--seconds 15]
    python -m bench.api_probes strings [--bursts 10] [--idle 11] [--teacher-mb 200]
    python -m bench.api_probes store [--seconds 30] [--records 10] [--soft-label-mib 104]
    python -m bench.api_probes health [--pollers 40] [--seconds 20] [--interval 0]
    python -m bench.api_probes catalog
    python -m bench.api_probes soft-labels [--epochs 300 1000 2000]

- `limits` (`limits.py`): requests that ask for work without bound, each refused with a 422;
- `floods` (`limits.py`): what a client can make the service spend or keep (error floods,
  non-finite numbers, slow sockets, the connection cap, anonymous floods, records, the Ray head);
- `strings` (`strings.py`): strings no encoder takes, descriptors under bursts, a broken
  teacher file, a damaged run;
- `store` (`store.py`): forwarded addresses, nested bodies, 413s, conditional requests, a repair
  under way, soft-label memory, the retention race, a full store;
- `health`, `catalog`, `soft-labels` (`probes.py`): the probes' latency under pollers with a
  distill running and the token rate limited, the first `/v1/datasets` after a start, the first
  soft-label download of many stored epochs.

Results: docs/benchmarks/api.md. `tests/test_api_*.py` assert what these measure.
"""

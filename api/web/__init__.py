"""HTTP, the top floor of the service: `bodies`, `refusals` (the 422s of bodies and query strings),
`http` (rate limits, HEAD, connection guards, the access log), `proxies`, `downloads` (files as
RFC 9110 answers them), `probes`, `service` (what the endpoints share, built from the settings),
`routes/` (one router per resource) and `app` (`create_app`)."""

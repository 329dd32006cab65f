"""The bottom floor of the service: what it says to a client. `schemas`: the REST bodies (request
and responses, from which FastAPI derives the OpenAPI schema); `service_errors`: its errors, each
the status it answers, and every error told in one line without anything internal. Imports
nothing of the service."""

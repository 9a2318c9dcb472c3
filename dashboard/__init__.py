"""The clusterdx server: a Django project split into apps that follow the data flow
(ingest -> telemetry -> live / web; diagnosis -> alerts)."""

"""The operator's audited cache quarantine: service, executors, admin routes."""

"""The tamper-evident audit log: entries, verification, the writer, the CLI."""

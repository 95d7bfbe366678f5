"""`fak audit isolation`: the prompt-cache timing audit (SEC-5) as a command: the config, the
streaming TTFT client, the request schedule, the report, the CLI."""

"""The judge of k3-lora-rl: the Kimi-K3 recipe's health criteria as data (``harness/spec/*.toml``), readers
for every place a run leaves its numbers, live watch with early abort, and reports. Never imports ``k3``:
it reads the run directory contract of docs/RUN_DIRECTORY.md. Usage: docs/HARNESS.md."""

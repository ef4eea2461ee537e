"""The `k3` launcher: CLI, layout derivation and validation, Ray placement, resolved-config dump."""

"""pytest plugin placeholder (filled by the harness)."""

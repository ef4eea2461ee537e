"""Run settings: frozen typed values built once by the launcher; each part takes only its own."""

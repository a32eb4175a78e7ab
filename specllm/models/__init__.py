"""Model management: the catalog (models.toml), downloads and checksums (hub), GGUF file checks (gguf),
and names to verified files (store). Imports the engine never; the engine never imports it."""

"""Where models come from: the config's list, models_dir, Ollama's store, Modelfiles, `create`, and
`pull` from registries into gpushare's own content-addressed store."""

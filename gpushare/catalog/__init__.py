"""Where models come from: the config's list, models_dir, Ollama's store, Modelfiles, `create`."""

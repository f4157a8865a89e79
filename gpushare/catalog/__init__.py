"""Where models come from: names, registries, pulls and gpushare's own content-addressed store."""

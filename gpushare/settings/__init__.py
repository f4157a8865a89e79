"""Settings: YAML and the environment -> typed, validated dataclasses; the one place that knows defaults."""

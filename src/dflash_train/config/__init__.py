"""The typed config tree: the schema (schema.py), YAML in with dotted `key=value` overrides (load.py), validation
before any model loads (validate.py)."""

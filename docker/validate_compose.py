"""Validate the compose files against the Compose Specification JSON schema, offline.

No Docker engine or compose plugin is needed: the schema is the one shipped inside the
PyPI wheel of docker-compose 1.29.2 (compose/config/compose_spec.json), which
.ci/checks downloads with `pip download`. Unknown keys and bad values are errors.

    python docker/validate_compose.py SCHEMA.json docker/compose.yaml docker/compose.gpu.yaml
"""
import json
import sys

import jsonschema
import yaml


def main(schema_path: str, *files: str) -> int:
    with open(schema_path) as f:
        validator = jsonschema.Draft7Validator(json.load(f))
    failed = 0
    for path in files:
        with open(path) as f:
            errors = list(validator.iter_errors(yaml.safe_load(f)))
        for error in errors:
            print(f"!! {path}: {'/'.join(map(str, error.absolute_path))}: {error.message}")
        print(f"   {path}: {'ok' if not errors else f'{len(errors)} errors'}")
        failed += bool(errors)
    return 1 if failed else 0


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    sys.exit(main(*sys.argv[1:]))

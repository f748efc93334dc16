"""Check a JobSet manifest against the JobSet CRD's OpenAPI v3 schema, as strictly as the API server would.

    kubectl get crd jobsets.jobset.x-k8s.io -o yaml > crd.yaml     # or config/components/crd/bases/ of
    python scripts/k8s/validate_jobset.py crd.yaml jobset.yaml      # kubernetes-sigs/jobset

Types, enums, required fields and formats come from the CRD's schema (``jsonschema``); unknown fields are
errors (the API server's strict field validation), and so is a ``x-kubernetes-int-or-string`` value that is
neither. What needs a cluster (admission webhooks, quota, the PVC existing) is not checked. Exit status 0: valid;
1: one line per problem.
"""

import sys

import jsonschema
import yaml


def strict(schema):
    """The schema with ``additionalProperties: false`` wherever it lists properties and says nothing else, and
    int-or-string made explicit."""
    if isinstance(schema, dict):
        out = {k: strict(v) for k, v in schema.items()}
        if "properties" in out and "additionalProperties" not in out and \
                not out.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
        if out.get("x-kubernetes-int-or-string"):
            out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
        return out
    if isinstance(schema, list):
        return [strict(v) for v in schema]
    return schema


def main(crd_path, manifest_path):
    crd = yaml.safe_load(open(crd_path))
    docs = [d for d in yaml.safe_load_all(open(manifest_path)) if d]
    problems = []
    for doc in docs:
        version = doc.get("apiVersion", "").rsplit("/", 1)[-1]
        match = [v for v in crd["spec"]["versions"] if v["name"] == version]
        if doc.get("kind") != crd["spec"]["names"]["kind"] or not match:
            problems.append(f"{manifest_path}: kind/apiVersion {doc.get('kind')}/{doc.get('apiVersion')} is not "
                            f"served by {crd['metadata']['name']}")
            continue
        schema = strict(match[0]["schema"]["openAPIV3Schema"])
        validator = jsonschema.Draft7Validator(schema, format_checker=jsonschema.FormatChecker())
        for err in sorted(validator.iter_errors(doc), key=lambda e: list(e.absolute_path)):
            path = ".".join(str(p) for p in err.absolute_path) or "(root)"
            problems.append(f"{manifest_path}: {path}: {err.message}")
        name = doc.get("metadata", {}).get("name", "")
        if not name:
            problems.append(f"{manifest_path}: metadata.name: required")
    for p in problems:
        print(f"error: {p}", file=sys.stderr)
    if not problems:
        print(f"ok: {manifest_path} ({len(docs)} document(s)) against {crd['metadata']['name']}")
    return 1 if problems else 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    sys.exit(main(sys.argv[1], sys.argv[2]))

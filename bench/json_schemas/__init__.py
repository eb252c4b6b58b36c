"""The JSON Schema corpus of `python -m bench.constrained`: realistic application schemas, each with
a short prompt asking a small chat model for that JSON.

What it is for: checking that constrained decoding (GenerateRequest.constraint.json_schema) gives
output that parses and validates, and timing the grammar compilation of schemas of the shapes
applications send: extraction (invoices, addresses, contacts, events, recipes, products, job
postings, medical notes), classification with enums, API payloads, configurations, nested and
recursive objects. Every schema is Draft 2020-12 and uses only keywords llguidance implements
(no `contains`, `uniqueItems`, `not`, `if`/`then`, `dependentRequired`, `propertyNames`; `oneOf`
only over branches it can tell apart, by a `const` discriminator or by type; `format` only where
llguidance enforces it); patterns are anchored, since llguidance, like JSON Schema, matches an
unanchored pattern anywhere in the string. Strings have a `maxLength` and arrays a `maxItems`, so
that a 135M model finishes each within about 200 tokens.

One module per kind of case (data only: `(name, prompt, schema)` tuples), gathered here into
`SCHEMAS`. The corpus's own checks are tests/bench/test_json_schemas.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bench.json_schemas import (
    api_payloads,
    classification,
    configs,
    extraction_business,
    extraction_documents,
    extraction_forms,
    extraction_records,
    nested,
)


@dataclass(frozen=True)
class SchemaCase:
    name: str
    prompt: str  # what the user asks; the benchmark appends the schema as text
    schema: dict[str, Any]


SCHEMAS: list[SchemaCase] = [
    SchemaCase(*case)
    for module in (extraction_documents, extraction_forms, extraction_records,
                   extraction_business, classification, api_payloads, configs, nested)
    for case in module.CASES]

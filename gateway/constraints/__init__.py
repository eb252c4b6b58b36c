"""Constraints: requests' JSON schemas, regexes, grammars and structural tags compiled to llguidance grammars."""

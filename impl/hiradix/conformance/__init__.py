"""The conformance layer: the only part of hiradix that sees both the implementation and
the model (spec/06, "Refinement"). Engine adapters, the state machine and the
``hiradix check`` command live here."""

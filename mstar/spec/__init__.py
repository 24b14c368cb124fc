"""Speculative decoding: draft-length schedule (`schedule`) and lossless verification of drafts (`verify`).

Import from the submodules (`from mstar.spec.verify import verify`): re-exporting the `verify` function
here would shadow the `mstar.spec.verify` module attribute.
"""

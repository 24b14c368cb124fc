"""Speculative decoding: draft-length schedule (`schedule`) and lossless verification of drafts (`verify`).

Import from the submodules (`from mstar.speculative.verify import verify`): re-exporting the `verify` function
here would shadow the `mstar.speculative.verify` module attribute.
"""

"""Start-up checks that run before any GPU time: config composition and the CLI (``cli``), data and
config checks (``checks``), cluster layout (``cluster``) and the dry-run plan (``plan``).

Imports only ``verl_ext``, omegaconf, pyarrow and (lazily) verl; the wiring at ``recipe.gdro`` imports it."""

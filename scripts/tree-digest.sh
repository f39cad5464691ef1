#!/usr/bin/env bash
# The digest of the Python sources under src/ and tests/ (16 hex digits): what a GPU test log was run on.
# `scripts/gpu-test.sh` writes it at the top of each log; run here, it tells whether a log covers this tree
# (the device's copy of .git can be stale, so a commit hash alone does not).
cd "$(dirname "${BASH_SOURCE[0]}")/.."
find src tests -type f -name '*.py' -print0 | LC_ALL=C sort -z | xargs -0 sha256sum | sha256sum | cut -c1-16

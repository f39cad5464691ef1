"""Helpers the tests share: `common` (markers, weights, subprocesses), and the CPU runners and
references of the generated-kernel backends (`codegen`, `staged`, `unrolled`)."""

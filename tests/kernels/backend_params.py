"""pytest parameters for one op's shared test body over its backends (attention, matmul)."""

import pytest


def backend_params(backends, cases, names_of, *, tiered=True, only_unsupported=False):
    """pytest params `(backend, case)` for the case names `names_of(backend)` gives.

    `cases` maps a case name to its case. `tiered`: cases outside the
    backend's default budget are marked slow. Cases the backend's flags exclude
    are skipped with the reason, or with `only_unsupported` are the only ones
    given.
    """
    params = []
    for backend in backends:
        for name in names_of(backend):
            case, marks = cases[name], list(backend.marks)
            reason = backend.unsupported(case)
            if only_unsupported != bool(reason):
                if only_unsupported:
                    continue
                marks.append(pytest.mark.skip(reason=reason))
            if tiered and name not in backend.default:
                marks.append(pytest.mark.slow)
            params.append(pytest.param(backend, case, id=f"{backend.name}-{name}", marks=marks))
    return params

# Sourced by the GPU tier scripts: pick_python prints the python to run on a GPU host — K3_PYTHON when set, else
# the first of python3 / .venv/bin/python whose torch sees CUDA, else .venv/bin/python (or python3) so that the
# caller's own CUDA check fails with its one-line message. The CPU .venv has no CUDA torch, hence the search.
pick_python() {
    if [[ -n "${K3_PYTHON:-}" ]]; then echo "$K3_PYTHON"; return; fi
    local cand
    for cand in python3 .venv/bin/python; do
        if command -v "$cand" >/dev/null 2>&1 &&
           "$cand" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; then
            echo "$cand"; return
        fi
    done
    if [[ -x .venv/bin/python ]]; then echo .venv/bin/python; else echo python3; fi
}

# venv_install VENV ARGS...: create VENV if it is missing and pip-install ARGS into it with uv,
# falling back to pip where uv cannot be installed. Sourced by the install scripts.
#
# uv resolves and installs the main venv in about 4 s where pip took 90 s of a 2-core machine's
# CPU (both measured from an empty cache, uv 0.13, pip 23.2), and CI installs five venvs. The
# venv itself comes from `python -m venv`, so its own pip stays there for users' later installs.
# uv writes no bytecode at install: modules compile on first import, only those a run imports.
venv_install() {
  local venv="$1"; shift
  [ -x "$venv/bin/python" ] || "${PYTHON:-python3}" -m venv "$venv"
  if [ -x "$venv/bin/uv" ] || "$venv/bin/python" -m pip install -q uv >/dev/null 2>&1; then
    "$venv/bin/uv" pip install -q --python "$venv/bin/python" "$@"
  else
    # This machine's pip config names local mirrors that may not exist; its warnings about them are noise.
    "$venv/bin/python" -m pip install -q "$@" \
      2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
  fi
}

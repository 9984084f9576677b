# shellcheck shell=bash
# Shared setup for scripts/dev and scripts/test. Source it; do not run it.
#
# After `ds3_venv_setup`, .venv exists and holds exactly requirements.lock plus ds3 itself
# (editable). It reinstalls only when requirements.lock or pyproject.toml changed since the
# last successful install: their combined sha256 is kept in .venv/.ds3-stamp.
# Quiet when there is nothing to do.
#
# Env: DS3_PYTHON   interpreter used to create .venv (default: python3; needs >= 3.11)
#      DS3_FORCE_INSTALL=1   reinstall even if the stamp matches

DS3_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DS3_VENV="$DS3_ROOT/.venv"

_ds3_hash() {  # sha256 of the given files, concatenated in order
  cat "$@" | sha256sum | cut -d' ' -f1
}

_ds3_lock() {  # serialize concurrent setups (two scripts/test at once) when flock exists
  if command -v flock >/dev/null 2>&1; then
    exec {_ds3_lock_fd}>"$1"
    flock "$_ds3_lock_fd"
  fi
}

_ds3_unlock() {
  if [ -n "${_ds3_lock_fd:-}" ]; then
    exec {_ds3_lock_fd}>&-
    unset _ds3_lock_fd
  fi
}

ds3_venv_setup() {
  local py="${DS3_PYTHON:-python3}"
  if [ ! -x "$DS3_VENV/bin/python" ]; then
    command -v "$py" >/dev/null 2>&1 || { echo "ds3: $py not found (need Python >= 3.11)" >&2; return 1; }
    "$py" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
      || { echo "ds3: $py is $("$py" -V 2>&1); need Python >= 3.11 (set DS3_PYTHON)" >&2; return 1; }
    echo "ds3: creating $DS3_VENV with $("$py" -V 2>&1)" >&2
    "$py" -m venv "$DS3_VENV" \
      || { echo "ds3: '$py -m venv' failed (on Debian/Ubuntu: apt-get install python3-venv)" >&2; return 1; }
  fi

  local stamp="$DS3_VENV/.ds3-stamp" want
  want="$(_ds3_hash "$DS3_ROOT/requirements.lock" "$DS3_ROOT/pyproject.toml")"
  if [ "${DS3_FORCE_INSTALL:-0}" != 1 ] && [ -x "$DS3_VENV/bin/ds3" ] \
     && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
    return 0
  fi

  _ds3_lock "$DS3_VENV/.ds3-install.lock"
  # Another process may have finished the same install while we waited for the lock.
  if [ "${DS3_FORCE_INSTALL:-0}" != 1 ] && [ -x "$DS3_VENV/bin/ds3" ] \
     && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
    _ds3_unlock; return 0
  fi
  echo "ds3: installing Python dependencies into .venv (requirements.lock / pyproject.toml changed)" >&2
  rm -f "$stamp"
  local pip=("$DS3_VENV/bin/python" -m pip --disable-pip-version-check --quiet)
  if ! "${pip[@]}" install -r "$DS3_ROOT/requirements.lock"; then
    echo "ds3: pip install -r requirements.lock failed" >&2; _ds3_unlock; return 1
  fi
  if ! "${pip[@]}" install --no-deps -e "$DS3_ROOT"; then
    echo "ds3: pip install -e . failed" >&2; _ds3_unlock; return 1
  fi
  echo "$want" >"$stamp"
  _ds3_unlock
  echo "ds3: .venv is up to date" >&2
}

# Our modules' bytecode, written ahead (quick when it is up to date). Every ds3 process imports
# about 200 of them at start; where PYTHONDONTWRITEBYTECODE is set (as on the development
# machines here) Python never writes their bytecode, so each process compiled them all again:
# 0.3 of its 1.0 CPU-seconds to start (pip writes the dependencies' bytecode when it installs).
ds3_bytecode() {
  "$DS3_VENV/bin/python" -m compileall -q -j 0 -x node_modules \
    "$DS3_ROOT/ds3" "$DS3_ROOT/shared" "$DS3_ROOT/ingester" "$DS3_ROOT/reader" "$DS3_ROOT/pipeline" \
    "$DS3_ROOT/tests" "$DS3_ROOT/scripts" >/dev/null \
    || echo "ds3: compileall failed (processes compile their modules as they start instead)" >&2
}

# Sourced by the reproduction scripts: `stage NAME COMMAND...` runs COMMAND once per output folder $OUT; a marker
# ($OUT/.done-NAME) records completion, and a stage interrupted midway runs again (training resumes itself).
stage() {
  local name=$1
  shift
  if [ -f "$OUT/.done-$name" ]; then
    echo "=== $name: done"
    return
  fi
  echo "=== $name"
  "$@"
  touch "$OUT/.done-$name"
}

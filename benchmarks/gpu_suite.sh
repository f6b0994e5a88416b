#!/usr/bin/env bash
# The GPU check as one command (benchmarks/gpu_suite.py says what it runs):
#   bash benchmarks/gpu_suite.sh OUTDIR [--dry-run] [--only STEPS] [--engine-cache FILE]
exec python3 "$(dirname "$0")/gpu_suite.py" "$@"

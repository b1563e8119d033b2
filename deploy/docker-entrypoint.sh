#!/bin/sh
# The Baton image's entrypoint (tests/test_deploy.py runs it without Docker).
#
# With no arguments, or only flags, it runs `baton serve` with them; any other
# command (`baton generate ...`, `sh`) runs as given. `baton serve` reads its
# configuration from BATON_* variables (every flag has one):
#   BATON_MODEL    a model folder or .gguf file under the mounted /models, or a
#                  Hugging Face Hub id fetched into HF_HOME (a volume; HF_TOKEN
#                  opens gated repositories); unset: the embedded SmolLM2-135M
#   BATON_API_KEY  the key clients send as `Authorization: Bearer KEY`; or a
#                  secret file: BATON_API_KEY_FILE, by default
#                  $BATON_SECRETS_DIR/baton_api_key (/run/secrets, where Docker
#                  and Kubernetes mount secrets) when that file exists
set -eu
secret="${BATON_SECRETS_DIR:-/run/secrets}/baton_api_key"
if [ -z "${BATON_API_KEY:-}" ] && [ -z "${BATON_API_KEY_FILE:-}" ] && [ -r "$secret" ]; then
    BATON_API_KEY_FILE="$secret"
    export BATON_API_KEY_FILE
fi
case "${1:-}" in
    "" | -*) set -- baton serve "$@" ;;
esac
exec "$@"

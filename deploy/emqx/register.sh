#!/usr/bin/env bash
# Register sdv-fanout at runtime through EMQX's REST API (5.x/6.x), then show its hooks.
# Needs an API key with the data_integration scope: EMQX_API_KEY / EMQX_API_SECRET.
set -euo pipefail
EMQX=${EMQX:-http://127.0.0.1:18083}
URL=${SDV_FANOUT_URL:-http://sdv-fanout.sdv.svc:9000}
curl -fsS -u "$EMQX_API_KEY:$EMQX_API_SECRET" -H 'content-type: application/json' \
  -X POST "$EMQX/api/v5/exhooks" -d @- <<JSON
{"name": "sdv-fanout", "enable": true, "url": "$URL", "request_timeout": "5s",
 "failed_action": "ignore", "pool_size": 8, "auto_reconnect": "60s"}
JSON
echo
curl -fsS -u "$EMQX_API_KEY:$EMQX_API_SECRET" "$EMQX/api/v5/exhooks/sdv-fanout"
echo
curl -fsS -u "$EMQX_API_KEY:$EMQX_API_SECRET" "$EMQX/api/v5/exhooks/sdv-fanout/hooks"
echo

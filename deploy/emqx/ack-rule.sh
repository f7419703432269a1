#!/usr/bin/env bash
# Create the EMQX rule that brings the vehicles' PUBACKs to sdv-fanout as MQTT messages, for a
# server with ack_topic_prefix = "$SDV-FANOUT/acked" (REST POST /api/v5/rules; EMQX 5.1 to 6.x).
# The rule and the setting go together: with the setting and no rule, no delivery is ever acked
# (the server logs rule_acks_missing); with the rule and no setting, the hook acks and the rule's
# messages reach nobody. For other settings print the body with `sdv-fanout ack-rule`.
# Needs an API key with the data_integration scope: EMQX_API_KEY / EMQX_API_SECRET.
# EMQX_BEFORE_5_8=1 posts ack-rule-5.1.json (no direct_dispatch: 5.1 fails every action with it).
set -euo pipefail
EMQX=${EMQX:-http://127.0.0.1:18083}
here=$(cd "$(dirname "$0")" && pwd)
body="$here/ack-rule.json"
if [ "${EMQX_BEFORE_5_8:-0}" = 1 ]; then body="$here/ack-rule-5.1.json"; fi
curl -fsS -u "$EMQX_API_KEY:$EMQX_API_SECRET" -H 'content-type: application/json' \
  -X POST "$EMQX/api/v5/rules" -d @"$body"
echo

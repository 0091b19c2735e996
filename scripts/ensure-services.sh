#!/usr/bin/env bash
# Makes sure PostgreSQL and RabbitMQ (with the management, STOMP, web-STOMP and event
# exchange plugins) answer on loopback. Starts them when installed but down; installs
# them with apt on Debian when missing and running as root. Idempotent.
#
#   ensure-services.sh            both (make test)
#   ensure-services.sh rabbitmq   RabbitMQ only (make run on its embedded PostgreSQL;
#                                 the local PostgreSQL too when QUEUEKEEPER_DATABASE_URL
#                                 points at it)
#
# When something cannot be done from here (not root), it stops with one line saying
# exactly what to run.
set -euo pipefail

log() { printf 'ensure-services: %s\n' "$*" >&2; }
# One line, the exact command, and stop.
stop_with() { printf 'ensure-services: %s\n' "$*" >&2; exit 1; }
as_root() { if [ "$(id -u)" = 0 ]; then printf '%s' "$*"; else printf 'sudo %s' "$*"; fi; }

want_postgresql=1
want_rabbitmq=1
if [ "${1:-}" = rabbitmq ]; then
  want_postgresql=0
  case "${QUEUEKEEPER_DATABASE_URL:-}" in
    postgres*://*@127.0.0.1[:/]*|postgres*://*@localhost[:/]*) want_postgresql=1 ;;
  esac
fi
port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
wait_port() { # port seconds
  for _ in $(seq 1 "$2"); do port_open "$1" && return 0; sleep 1; done
  return 1
}
apt_install() {
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    stop_with "$* is not installed; run: sudo apt-get install -y $* && make ${MAKE_TARGET:-run}"
  fi
  log "installing $* with apt"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq "$@" >/dev/null
}

# --- PostgreSQL -----------------------------------------------------------------
if [ "$want_postgresql" = 1 ] && ! port_open 5432; then
  if ! ls /etc/postgresql/*/main >/dev/null 2>&1; then apt_install postgresql; fi
  version=$(ls /etc/postgresql | sort -V | tail -n 1)
  log "starting PostgreSQL $version"
  pg_ctlcluster --skip-systemctl-redirect "$version" main start || true
  wait_port 5432 60 || stop_with "PostgreSQL is down; run: $(as_root pg_ctlcluster --skip-systemctl-redirect "$version" main start)"

  # A fresh Debian cluster only trusts local socket peers: allow loopback as the tests expect.
  if ! psql -h 127.0.0.1 -U postgres -c 'select 1' >/dev/null 2>&1; then
    hba=/etc/postgresql/$version/main/pg_hba.conf
    log "allowing trust auth on loopback in $hba"
    sed -i '1i host all all 127.0.0.1/32 trust\nhost all all ::1/128 trust' "$hba"
    pg_ctlcluster --skip-systemctl-redirect "$version" main reload
  fi
fi

# --- RabbitMQ -----------------------------------------------------------------------
PLUGINS="rabbitmq_management rabbitmq_stomp rabbitmq_web_stomp rabbitmq_event_exchange"
# The event exchange opens no port: it is up when the Management API shows the exchange it
# declares (`amq.rabbitmq.event` in vhost /), asked as the local default user (RABBITMQ_USER
# and RABBITMQ_PASSWORD override guest/guest), so no root or Erlang cookie is needed to ask.
# Presence (consumers arriving and leaving) is learnt from it (docs/architecture.md).
event_exchange_up() {
  python3 - "${RABBITMQ_USER:-guest}" "${RABBITMQ_PASSWORD:-guest}" 2>/dev/null <<'EOF'
import base64, sys, urllib.request
request = urllib.request.Request("http://127.0.0.1:15672/api/exchanges/%2F/amq.rabbitmq.event")
login = base64.b64encode(f"{sys.argv[1]}:{sys.argv[2]}".encode()).decode()
request.add_header("Authorization", f"Basic {login}")
urllib.request.urlopen(request, timeout=5)
EOF
}
plugins_up() { port_open 15672 && port_open 15674 && port_open 61613 && event_exchange_up; }
if [ "$want_rabbitmq" = 1 ] && ! { port_open 5672 && plugins_up; }; then
  if ! command -v rabbitmq-server >/dev/null && ! [ -x /usr/sbin/rabbitmq-server ]; then
    apt_install rabbitmq-server
  fi
  if ! port_open 5672; then
    log "starting RabbitMQ"
    rabbitmq-server -detached 2>/dev/null || true
    wait_port 5672 120 || stop_with "RabbitMQ is down; run: $(as_root rabbitmq-server -detached)"
  fi
  # Wait until the node itself answers: the AMQP port opens before plugins can be enabled.
  for _ in $(seq 1 60); do rabbitmqctl -q status >/dev/null 2>&1 && break; sleep 1; done
  if ! plugins_up; then
    log "enabling $PLUGINS"
    # shellcheck disable=SC2086
    # Online: enabling plugins on a running node neither restarts it nor drops connections.
    rabbitmq-plugins enable $PLUGINS >/dev/null 2>&1 \
      || stop_with "RabbitMQ lacks its plugins; run: $(as_root rabbitmq-plugins enable $PLUGINS)"
  fi
  for port in 15672 15674 61613; do
    wait_port "$port" 60 || stop_with "RabbitMQ's plugins do not answer on port $port; run: $(as_root rabbitmq-plugins enable $PLUGINS) and check $(as_root rabbitmqctl status)"
  done
fi
services=()
[ "$want_postgresql" = 1 ] && services+=(PostgreSQL)
[ "$want_rabbitmq" = 1 ] && services+=("RabbitMQ (management, STOMP, web-STOMP, event exchange)")
log "up: ${services[*]}"

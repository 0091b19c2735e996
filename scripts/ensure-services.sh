#!/usr/bin/env bash
# Makes sure PostgreSQL and RabbitMQ (with the management, STOMP and web-STOMP
# plugins) answer on loopback. Starts them when installed but down; installs
# them with apt on Debian when missing and running as root. Idempotent.
set -euo pipefail

log() { printf 'ensure-services: %s\n' "$*" >&2; }
port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
wait_port() { # port seconds name
  for _ in $(seq 1 "$2"); do port_open "$1" && return 0; sleep 1; done
  log "$3 did not open port $1 within $2 s"; return 1
}
apt_install() {
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    log "cannot install $*: not root on a Debian machine; install them and re-run"; exit 1
  fi
  log "installing $* with apt"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq "$@" >/dev/null
}

# --- PostgreSQL -----------------------------------------------------------------
if ! port_open 5432; then
  if ! ls /etc/postgresql/*/main >/dev/null 2>&1; then apt_install postgresql; fi
  version=$(ls /etc/postgresql | sort -V | tail -n 1)
  log "starting PostgreSQL $version"
  pg_ctlcluster --skip-systemctl-redirect "$version" main start || true
  wait_port 5432 60 PostgreSQL
  # A fresh Debian cluster only trusts local socket peers: allow loopback as the tests expect.
  if ! psql -h 127.0.0.1 -U postgres -c 'select 1' >/dev/null 2>&1; then
    hba=/etc/postgresql/$version/main/pg_hba.conf
    log "allowing trust auth on loopback in $hba"
    sed -i '1i host all all 127.0.0.1/32 trust\nhost all all ::1/128 trust' "$hba"
    pg_ctlcluster --skip-systemctl-redirect "$version" main reload
  fi
fi

# --- RabbitMQ -----------------------------------------------------------------------
if ! command -v rabbitmq-server >/dev/null && ! [ -x /usr/sbin/rabbitmq-server ]; then
  apt_install rabbitmq-server
fi
if ! port_open 5672; then
  log "starting RabbitMQ"
  rabbitmq-server -detached
  wait_port 5672 120 RabbitMQ
fi
# Wait until the node itself answers: the AMQP port opens before plugins can be enabled.
for _ in $(seq 1 60); do rabbitmqctl -q status >/dev/null 2>&1 && break; sleep 1; done
if ! port_open 15672 || ! port_open 15674 || ! port_open 61613; then
  log "enabling rabbitmq_management rabbitmq_stomp rabbitmq_web_stomp"
  rabbitmq-plugins enable rabbitmq_management rabbitmq_stomp rabbitmq_web_stomp >/dev/null
fi
wait_port 15672 60 "RabbitMQ management"
wait_port 15674 60 "RabbitMQ web-STOMP"
wait_port 61613 60 "RabbitMQ STOMP"
log "PostgreSQL and RabbitMQ are up (management, STOMP, web-STOMP enabled)"

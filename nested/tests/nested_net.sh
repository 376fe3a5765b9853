# L1 script of nested_net.rs (busybox sh; @NAME@ are filled in by the test).
test -c /dev/kvm || { echo 'L1 has no /dev/kvm'; exit 97; }
T=/opt/torpor/torpor
# iproute2's ip (carried): busybox sh runs its own applet for a bare `ip`.
IP=/usr/local/sbin/ip
export TORPOR_API=http://127.0.0.1:7700 TORPOR_TOKEN=nested-token
API=$TORPOR_API
c() { curl -sS -H "Authorization: Bearer $TORPOR_TOKEN" -H 'Content-Type: application/json' "$@"; }
now() { cut -d' ' -f1 /proc/uptime; }
sbx() { c "$API/v1/sandboxes/$1"; }
# A JSON field of a sandbox (first occurrence; numbers and strings).
jf() { sbx "$1" | grep -o "\"$2\":\(\"[^\"]*\"\|[0-9]*\)" | head -n1 | cut -d: -f2- | tr -d '"'; }
state() { jf "$1" state; }
create() { c -X POST "$API/v1/sandboxes" -d "$1" | grep -o '"id":"sbx_[^"]*"' | head -n1 | cut -d'"' -f4; }
x() { s=$1; shift; $T sandbox exec "$s" -- "$@"; }
pss() { awk '/^Pss:/ {print $2}' "/proc/$1/smaps_rollup"; }
shared() { awk '/^Shared_(Clean|Dirty):/ {s += $2} END {print s + 0}' "/proc/$1/smaps_rollup"; }
count() {
  echo "leftovers-$1 netns=$($IP netns list | grep -c '^torpor-sbx') veths=$($IP -o link show | grep -c ': tpv')" \
    "rules=$(nft list table ip torpor 2>/dev/null | grep -c 'comment "torpor:')" \
    "sets=$(nft list sets ip 2>/dev/null | grep -c 'set tpv')"
}

# --- the test's servers -------------------------------------------------------
# The "internet": a namespace beyond L1 holding 192.0.2.1 and .2 (guests
# never reach L1's own addresses but through serve --host-allow).
$IP link set lo up
$IP netns add world
$IP link add wv0 type veth peer name eth0 netns world
$IP addr add 198.51.100.1/30 dev wv0
$IP link set wv0 up
$IP -n world link set lo up
$IP -n world addr add 198.51.100.2/30 dev eth0
$IP -n world link set eth0 up
$IP -n world addr add 192.0.2.1/32 dev lo
$IP -n world addr add 192.0.2.2/32 dev lo
$IP -n world route add default via 198.51.100.1
$IP route add 192.0.2.0/30 via 198.51.100.2
# Cloud metadata's address, routed beyond L1 too: only the walls stop it.
$IP -n world addr add 169.254.169.254/32 dev lo
$IP route add 169.254.169.254/32 via 198.51.100.2
# A service of L1 itself, opened to guests with --host-allow (its peers
# are the sandboxes' own addresses: no masquerade on the way in).
$IP addr add 192.0.2.9/32 dev lo
W=/srv/www
mkdir -p $W/cgi-bin $W/simple/tinypkg $W/packages
cp /opt/torpor/blob.bin $W/blob.bin
WHEEL=tinypkg-1.0-py3-none-any.whl
cp /opt/torpor/$WHEEL $W/packages/
WSHA=$(sha256sum <$W/packages/$WHEEL | cut -d' ' -f1)
printf '<!DOCTYPE html><html><body><a href="../../packages/%s#sha256=%s">%s</a></body></html>\n' \
  $WHEEL "$WSHA" $WHEEL >$W/simple/tinypkg/index.html
printf '#!/bin/sh\nprintf "Content-Type: text/plain\\r\\n\\r\\n%%s\\n" "$REMOTE_ADDR"\n' >$W/cgi-bin/whoami
chmod 755 $W/cgi-bin/whoami
$IP netns exec world httpd -p 8000 -h $W
httpd -p 192.0.2.9:8000 -h $W
# A PostgreSQL/NATS-like service of L1 on every address (not opened to
# guests by --host-allow): the walls keep guests from it.
httpd -p 5432 -h $W
echo "blob sha=$(sha256sum <$W/blob.bin | cut -d' ' -f1)"
echo "wheel sha=$WSHA"

# --- the service --------------------------------------------------------------
IMAGES="$(dirname "$(readlink -f /opt/torpor/rootfs.ext4)")/images"
mkdir -p "$IMAGES/debian"
mv "$(readlink -f /opt/torpor/vmlinux)" "$(readlink -f /opt/torpor/rootfs.ext4)" "$IMAGES/debian/"
chmod 0644 "$IMAGES/debian/vmlinux" "$IMAGES/debian/rootfs.ext4"
serve() {
  $T serve --data-dir /tmp/data --token nested-token --keep-alive-ms 3600000 \
    --images-dir "$IMAGES" --request-timeout-ms 600000 \
    --sandbox-network --sandbox-dns-port 0 --host-allow 192.0.2.9/32:8000 >>/tmp/serve.log 2>&1 &
  SERVE=$!
  i=0; until $T template list >/dev/null 2>&1 || [ $i -ge 300 ]; do sleep 0.2; i=$((i+1)); done
  $T template list >/dev/null 2>&1 || { echo "serve did not start:"; cat /tmp/serve.log; exit 1; }
}
serve
# One vCPU per guest: four guests run at once in a 2-vCPU L1 under TCG
# (with two each, L1's kernel wedged in 2 of 5 runs, once seen while the
# three clones started), and no secondary vCPU to bring up
# (docs/testing.md, "Linux guests in the nested host").
$T template create --name debian --kind linux --image debian --mem-mib 512 --vcpus 1 >/tmp/tpl 2>&1
rc=$?
echo "template rc=$rc $(tr '\n' ' ' </tmp/tpl)"
[ $rc = 0 ] || { tail -n 40 /tmp/serve.log; exit 1; }
$T template list >/dev/null 2>&1 || { echo "serve died:"; cat /tmp/serve.log; exit 1; }
count after-template

# --- egress policy ------------------------------------------------------------
A=$(create '{"template":"debian","network":{"allow_internet":false}}')
echo "sandbox-a id=$A state=$(state "$A")"
fetch() { # sandbox url -> sha256 of what it fetched, or "no"
  x "$1" sh -c "curl -sS --max-time 10 -o /tmp/f '$2' && sha256sum </tmp/f | cut -d' ' -f1" 2>/dev/null || echo no
}
echo "closed ok=$(fetch "$A" http://192.0.2.1:8000/blob.bin)"
c -X PATCH "$API/v1/sandboxes/$A/network" -d '{"allow_out":["192.0.2.1/32"]}' >/dev/null
echo "opened sha=$(fetch "$A" http://192.0.2.1:8000/blob.bin)"
echo "neighbour ok=$(fetch "$A" http://192.0.2.2:8000/blob.bin)"
x "$A" sh -c 'rm -rf /tmp/dl; pip download --no-deps --disable-pip-version-check --no-cache-dir \
  --index-url http://192.0.2.1:8000/simple/ --trusted-host 192.0.2.1 -d /tmp/dl tinypkg==1.0 >/tmp/pip.log 2>&1;
  rc=$?; tail -n 3 /tmp/pip.log; echo "pip rc=$rc sha=$(sha256sum </tmp/dl/'$WHEEL' | cut -d" " -f1)"'
echo "drops n=$(sbx "$A" | grep -o '"dropped_packets":[0-9]*' | cut -d: -f2)"

# --- an exposed port, and a wake by traffic to it -----------------------------
x "$A" sh -c 'mkdir -p /root/www && echo served-by-the-guest >/root/www/hello.txt &&
  cd /root/www && setsid python3 -m http.server 8080 </dev/null >/dev/null 2>&1 &'
PORT=$(c -X POST "$API/v1/sandboxes/$A/ports" -d '{"guest_port":8080}' | grep -o '"address":"[^"]*"' | cut -d'"' -f4)
echo "port address=$PORT"
get() { curl -sS --max-time 300 "http://$PORT/hello.txt"; }
i=0; until get >/dev/null 2>&1 || [ $i -ge 30 ]; do sleep 1; i=$((i+1)); done
echo "port-running body=$(get)"
$T sandbox hibernate "$A" >/dev/null
echo "port-hibernated state=$(state "$A")"
t0=$(now)
# (Not -o /dev/stdout: L1's devtmpfs has no such link, curl would make a file.)
body=$(curl -sS --max-time 300 -w ' ttfb=%{time_starttransfer}' "http://$PORT/hello.txt" 2>&1)
echo "port-woken body=$(echo "$body" | tr '\n' ' ') from=$t0 to=$(now)"
echo "port-after state=$(state "$A")"

# --- three clones at once -----------------------------------------------------
for i in 1 2 3; do create '{"template":"debian"}' >/tmp/clone$i & eval "p$i=\$!"; done
wait $p1 $p2 $p3
# Each clone's agent answers first (a refusal right after a create is
# logged: seen once under three concurrent creates on TCG).
for i in 1 2 3; do
  S=$(cat /tmp/clone$i) j=0
  until x "$S" true 2>/tmp/ready$i || [ $j -ge 30 ]; do j=$((j+1)); sleep 1; done
  [ $j = 0 ] || echo "clone-$i-agent-retries n=$j first=$(head -c 200 /tmp/ready$i | tr '\n' ' ')"
done
for i in 1 2 3; do
  S=$(cat /tmp/clone$i)
  (x "$S" curl -sS --max-time 30 http://192.0.2.9:8000/cgi-bin/whoami >/tmp/seen$i 2>&1) &
  eval "p$i=\$!"
done
wait $p1 $p2 $p3
for i in 1 2 3; do
  S=$(cat /tmp/clone$i)
  # httpd listens on IPv6 too: a v4 peer is [::ffff:a.b.c.d].
  echo "clone-$i id=$S api=$(jf "$S" address) seen=$(tr -d '\r\n []' </tmp/seen$i | sed 's/^::ffff://')"
done
C1=$(cat /tmp/clone1) C2=$(cat /tmp/clone2) C3=$(cat /tmp/clone3)

# --- the walls: whatever its policy, a guest reaches neither L1's own
# services (but --host-allow's), nor another sandbox, nor link-local ---------
x "$C2" sh -c 'mkdir -p /root/w && echo other-sandbox >/root/w/x &&
  cd /root/w && setsid python3 -m http.server 8081 </dev/null >/dev/null 2>&1 &'
HOSTEND=$($IP -4 -o addr show | awk '$2 ~ /^tpv/ {sub("/.*", "", $4); print $4; exit}')
wall() { # name url: "no" if the guest of C1 cannot fetch it (decided in
  # the guest by curl's own exit status; empty if the exec itself failed)
  echo "wall-$1 got=$(x "$C1" sh -c "curl -sS --max-time 8 -o /dev/null '$2' && echo ok || echo no" 2>/dev/null)"
}
wall control http://192.0.2.1:8000/blob.bin
wall l1-service http://198.51.100.1:5432/blob.bin
wall l1-hostend "http://$HOSTEND:5432/blob.bin"
wall l1-allowed-addr-other-port http://192.0.2.9:5432/blob.bin
wall l1-api "http://$HOSTEND:7700/healthz"
wall metadata http://169.254.169.254:8000/blob.bin
i=0; until x "$C2" sh -c 'curl -sS --max-time 2 -o /dev/null http://127.0.0.1:8081/x' 2>/dev/null || [ $i -ge 20 ]; do sleep 1; i=$((i+1)); done
wall other-sandbox "http://$(jf "$C2" address):8081/x"

# --- kill -9 of the service (and of one VMM), restart, delete: no leftovers ---
# The victim's VMM pid, read while the API still answers.
VICTIM=$(jf "$C3" pid)
echo "victim pid=$VICTIM"
count before-kill
kill -9 $SERVE
kill -9 "$VICTIM"
i=0; while kill -0 "$VICTIM" 2>/dev/null && [ $i -lt 50 ]; do sleep 0.1; i=$((i+1)); done
echo "victim-gone ok=$(kill -0 "$VICTIM" 2>/dev/null && echo no || echo yes)"
serve
live=0
for s in "$A" "$C1" "$C2" "$C3"; do [ "$(state "$s")" = running ] && live=$((live + 1)); done
echo "live n=$live"
count after-restart
echo "port-after-restart body=$(curl -sS --max-time 300 "http://$PORT/hello.txt")"
for s in "$A" "$C1" "$C2" "$C3"; do $T sandbox rm "$s" >/dev/null; done
count after-delete
kill $SERVE; wait $SERVE
count after-stop
grep -i 'error\|warn\|panic' /tmp/serve.log | tail -n 20 | sed 's/^/serve-log /'

//! Round trips through a lab's NAT from the client: a UDP echo server on the server host and a
//! Python client whose checks append what failed to `bad` (the server address is `sys.argv[1]`).

use pliant_lab::{Lab, Role, SERVER_IP};
use std::time::Duration;

const ECHO: &str = "import socket\n\
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n\
s.bind(('0.0.0.0', 7777))\n\
while True:\n\
\x20   d, a = s.recvfrom(65535)\n\
\x20   s.sendto(d, a)\n";

/// Python checks: `flows` UDP sockets each send `bytes` random bytes to the echo server (up to
/// `tries` times, 0.5 s apart) and expect them back; failures are labelled `label <i> (port
/// <p>)`.
pub fn udp_round_trips(label: &str, flows: usize, bytes: usize, tries: usize) -> String {
    format!(
        "for i in range({flows}):\n\
         \x20   d = os.urandom({bytes})\n\
         \x20   s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n\
         \x20   s.settimeout(0.5)\n\
         \x20   got = 'no reply'\n\
         \x20   for _ in range({tries}):\n\
         \x20       s.sendto(d, (sys.argv[1], 7777))\n\
         \x20       try:\n\
         \x20           r, a = s.recvfrom(65535)\n\
         \x20       except socket.timeout:\n\
         \x20           continue\n\
         \x20       got = 'ok' if r == d else 'mismatch %d bytes' % len(r)\n\
         \x20       break\n\
         \x20   if got != 'ok':\n\
         \x20       bad.append('{label} %d (port %d): %s' % (i, s.getsockname()[1], got))\n"
    )
}

/// Runs the echo server, then `checks` on the client (bounded by `timeout`); returns `ok` or
/// what failed (the client's output).
pub fn run_client(lab: &Lab, checks: &str, timeout: Duration) -> String {
    let dir = lab.run_dir().to_path_buf();
    let (echo, client) = (dir.join("echo.py"), dir.join("client.py"));
    let script = format!(
        "import http.client, os, socket, sys\nbad = []\n{checks}\
         print('; '.join(bad) if bad else 'ok')\n"
    );
    std::fs::write(&echo, ECHO).expect("write echo");
    std::fs::write(&client, script).expect("write client");
    let mut echo_server = lab
        .spawn(
            Role::Server,
            &["python3", &echo.display().to_string()],
            &dir.join("echo.log"),
        )
        .expect("echo server");
    let out = lab
        .exec_timeout(
            Role::Client,
            &["python3", &client.display().to_string(), SERVER_IP],
            timeout,
        )
        .expect("client");
    echo_server.kill().ok();
    echo_server.wait().ok();
    format!("{}{}", out.stdout.trim(), out.stderr.trim())
}

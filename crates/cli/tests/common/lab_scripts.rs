//! Python scripts run in a lab: a server script on the server host and a client script on the
//! client, e.g. round trips through the lab's NAT to a UDP echo server, whose checks append
//! what failed to `bad` (the server address is `sys.argv[1]`).

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
    let script = format!(
        "import http.client, os, socket, sys\nbad = []\n{checks}\
         print('; '.join(bad) if bad else 'ok')\n"
    );
    run_scripts(lab, ECHO, &script, timeout)
}

/// Starts `server` (Python) on the server host, runs `client` on the client with the server's
/// address as its argument (bounded by `timeout`), stops the server; returns the client's
/// output (stdout, then stderr, trimmed).
pub fn run_scripts(lab: &Lab, server: &str, client: &str, timeout: Duration) -> String {
    let dir = lab.run_dir().to_path_buf();
    let (server_py, client_py) = (dir.join("server.py"), dir.join("client.py"));
    std::fs::write(&server_py, server).expect("write server script");
    std::fs::write(&client_py, client).expect("write client script");
    let mut server = lab
        .spawn(
            Role::Server,
            &["python3", &server_py.display().to_string()],
            &dir.join("server.log"),
        )
        .expect("server script");
    let out = lab
        .exec_timeout(
            Role::Client,
            &["python3", &client_py.display().to_string(), SERVER_IP],
            timeout,
        )
        .expect("client script");
    server.kill().ok();
    server.wait().ok();
    format!("{}{}", out.stdout.trim(), out.stderr.trim())
}

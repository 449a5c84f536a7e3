//! `pliant smr up`: three copies of redis-server behind one front; a client's writes reach
//! them; SIGTERM stops the process and every copy it started.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Kills the command by its PID if the test fails before it stops (its Drop kills the servers
/// only when it exits normally, so SIGTERM first).
struct Up(Child);

impl Drop for Up {
    fn drop(&mut self) {
        // SAFETY: kill(2) on our own child's PID.
        unsafe { libc::kill(self.0.id() as i32, libc::SIGTERM) };
        let _ = self.0.wait();
    }
}

fn resp(s: &mut TcpStream, args: &[&str]) -> String {
    let mut b = format!("*{}\r\n", args.len());
    for a in args {
        b.push_str(&format!("${}\r\n{a}\r\n", a.len()));
    }
    s.write_all(b.as_bytes()).unwrap();
    let mut line = String::new();
    BufReader::new(s).read_line(&mut line).unwrap();
    line.trim_end().to_string()
}

#[test]
fn up_serves_through_the_leader_and_stops_its_servers_on_sigterm() {
    if !pliant_testkit::require_tool("redis-server", "redis-server") {
        return;
    }
    let dir = std::env::temp_dir().join(format!("smr-cli-{}", std::process::id()));
    let child = Command::new(env!("CARGO_BIN_EXE_pliant"))
        .args([
            "smr",
            "up",
            "--replicas",
            "3",
            "--dir",
            dir.to_str().unwrap(),
            "--",
        ])
        .args([
            "redis-server",
            "--port",
            "{port}",
            "--bind",
            "127.0.0.1",
            "--save",
            "",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut up = Up(child);
    let mut err = String::new();
    let stdout = up.0.stdout.take().unwrap();
    let mut lines = BufReader::new(stdout).lines();
    // "leader N clients -> host:port"
    let leader = lines.next().expect("a leader line").unwrap();
    let front = leader.rsplit(' ').next().unwrap().to_string();
    let mut c = TcpStream::connect(&front).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    assert_eq!(resp(&mut c, &["SET", "k", "v"]), "+OK");
    assert_eq!(resp(&mut c, &["INCR", "n"]), ":1");
    drop(c);

    // SAFETY: kill(2) on our own child's PID.
    unsafe { libc::kill(up.0.id() as i32, libc::SIGTERM) };
    let t0 = Instant::now();
    let status = loop {
        if let Some(s) = up.0.try_wait().unwrap() {
            break s;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(15),
            "still running after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    up.0.stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    assert!(status.success(), "{status}: {err}");
    // Every server the command printed is gone.
    let servers: Vec<&str> = err
        .lines()
        .filter_map(|l| l.split(" server ").nth(1))
        .collect();
    assert_eq!(servers.len(), 3, "{err}");
    for s in servers {
        assert!(TcpStream::connect(s).is_err(), "server {s} still accepts");
    }
    assert!(!dir.exists(), "the command removes its directory");
}

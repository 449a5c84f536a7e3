//! The demo binary: two instance processes hand a streaming client's session back and forth,
//! driven through their standard input.

mod common;

use common::{private_netns, start_client, tcp_counter};
use std::io::{BufRead, BufReader, Lines, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};

/// A demo process, killed (by its own pid) and reaped when dropped, even when the test fails.
struct Demo {
    child: Child,
    stdin: ChildStdin,
    out: Lines<BufReader<ChildStdout>>,
    clients: String,
    peer: String,
}

impl Demo {
    fn start(dir: &std::path::Path, name: &str) -> Demo {
        let mut child = Command::new(env!("CARGO_BIN_EXE_pliant-slice-demo"))
            .args(["serve", "--name", name, "--identity"])
            .arg(dir.join(name))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take().unwrap();
        let mut out = BufReader::new(child.stdout.take().unwrap()).lines();
        let ready = out.next().unwrap().unwrap();
        let pliant_slice::demo::Ready { clients, peer, .. } =
            pliant_slice::demo::parse_ready(&ready).unwrap_or_else(|| panic!("{ready:?}"));
        Demo {
            child,
            stdin,
            out,
            clients,
            peer,
        }
    }

    /// Sends a command, returns the answer lines (up to `done` for a move).
    fn cmd(&mut self, c: &str) -> Vec<String> {
        writeln!(self.stdin, "{c}").unwrap();
        let mut v = Vec::new();
        for l in self.out.by_ref() {
            let l = l.unwrap();
            let last = !c.starts_with("move") || l == "done";
            v.push(l);
            if last {
                break;
            }
        }
        v
    }
}

impl Drop for Demo {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn two_demo_processes_hand_a_live_session_back_and_forth() {
    if !private_netns() {
        return;
    }
    let dir = pliant_testkit::TempDir::new("pliant-slice-demo");
    let st = Command::new(env!("CARGO_BIN_EXE_pliant-slice-demo"))
        .arg("keys")
        .arg(&dir.0)
        .args(["demo-a", "demo-b"])
        .status()
        .unwrap();
    assert!(st.success());
    let mut a = Demo::start(&dir.0, "demo-a");
    let mut b = Demo::start(&dir.0, "demo-b");
    let c = start_client(&a.clients, 0);
    assert!(c.progresses(100));
    for round in 0..20 {
        let (src, dst) = if round % 2 == 0 {
            (&mut a, &mut b)
        } else {
            (&mut b, &mut a)
        };
        let cmd = format!(
            "move all {} {}",
            dst.peer,
            if round % 2 == 0 { "demo-b" } else { "demo-a" }
        );
        let answer = src.cmd(&cmd);
        assert_eq!(answer.len(), 2, "round {round}: {answer:?}");
        assert!(answer[0].starts_with("moved "), "round {round}: {answer:?}");
        assert_eq!(dst.cmd("list")[0].split_whitespace().count(), 2);
        assert!(c.progresses(100), "round {round}: the session stalled");
    }
    c.finish();
    for d in [&mut a, &mut b] {
        let s = d.cmd("stats");
        assert!(s[0].contains("session_errors=0"), "{s:?}");
    }
    assert_eq!(tcp_counter("OutRsts"), 0);
}

//! The demo binary: two instance processes hand a streaming client's session back and forth,
//! driven through their standard input.

mod common;

use common::{private_netns, start_client, tcp_counter, Demo};
use std::process::Command;

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
    let mut a = Demo::start(&dir.0, "demo-a", &[]);
    let mut b = Demo::start(&dir.0, "demo-b", &[]);
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

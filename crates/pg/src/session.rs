//! Per-session bookkeeping the proxy needs to move a client session to another server:
//! transaction status, replayable state, and the request cycle in flight.
//!
//! Pure logic (no sockets) so it is unit-tested beside the code; `proxy.rs` drives it.

use crate::proto::{self, Frame};
use std::collections::{HashMap, VecDeque};

/// Bounds of what a session keeps for replay; exceeding one makes the session unreplayable
/// (counted), never silently drops state.
pub const MAX_REPLAY_SETS: usize = 256;
pub const MAX_PREPARED: usize = 1024;
pub const MAX_INFLIGHT_BYTES: usize = 1 << 20;

/// Why a session cannot be moved to a new server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unreplayable {
    TempTable,
    AdvisoryLock,
    Listen,
    Copy,
    ReplayBound,
}

impl Unreplayable {
    pub fn what(self) -> &'static str {
        match self {
            Unreplayable::TempTable => "a temporary table",
            Unreplayable::AdvisoryLock => "a session advisory lock",
            Unreplayable::Listen => "LISTEN",
            Unreplayable::Copy => "an unfinished COPY",
            Unreplayable::ReplayBound => "more session state than the proxy keeps",
        }
    }
}

/// Lower-cased statement text without leading whitespace/comments-free prefix.
fn norm(sql: &str) -> String {
    sql.trim_start().to_ascii_lowercase()
}

/// First word of a statement.
fn first_word(n: &str) -> &str {
    n.split(|c: char| c.is_whitespace() || c == ';' || c == '(')
        .next()
        .unwrap_or("")
}

/// True for COMMIT / END (not COMMIT PREPARED), i.e. a statement that commits the open block.
pub fn is_commit(sql: &str) -> bool {
    let n = norm(sql);
    let w = first_word(&n);
    (w == "commit" || w == "end") && !n.contains("prepared")
}

pub fn is_rollback(sql: &str) -> bool {
    let n = norm(sql);
    matches!(first_word(&n), "rollback" | "abort")
}

/// Statements that may be sent again to a new server after a failure without changing the
/// outcome (no side effects): plain SELECTs without function calls, SHOW, BEGIN, SET.
pub fn is_idempotent(sql: &str) -> bool {
    let n = norm(sql);
    let w = first_word(&n);
    match w {
        "begin" | "start" | "show" => {
            !n.contains(';') || n.trim_end().trim_end_matches(';').find(';').is_none()
        }
        "select" => {
            !n.contains('(')
                && !n.contains(" into ")
                && !n.contains("for update")
                && !n.contains("for share")
                && n.trim_end().trim_end_matches(';').find(';').is_none()
        }
        _ => false,
    }
}

/// Session-level state that a statement creates and that cannot be recreated on a new server.
pub fn unreplayable_effect(sql: &str) -> Option<Unreplayable> {
    let n = norm(sql);
    if (n.contains("temp ") || n.contains("temporary ")) && n.contains("create") {
        return Some(Unreplayable::TempTable);
    }
    if n.contains("pg_advisory_lock") || n.contains("pg_try_advisory_lock") {
        return Some(Unreplayable::AdvisoryLock);
    }
    if first_word(&n) == "listen" || n.contains(";listen") || n.contains("; listen") {
        return Some(Unreplayable::Listen);
    }
    None
}

/// SET/RESET/DISCARD classification for the replay log.
#[derive(Debug, PartialEq, Eq)]
pub enum SetKind {
    /// Session-level SET/RESET: replay it.
    Record,
    /// RESET ALL / DISCARD ALL: forget the log (and, for DISCARD ALL, prepared statements).
    Clear {
        prepared: bool,
    },
    None,
}

pub fn set_kind(sql: &str) -> SetKind {
    let n = norm(sql);
    let w = first_word(&n);
    let rest = n[w.len()..].trim_start();
    match w {
        "set" if rest.starts_with("local") || rest.starts_with("transaction") => SetKind::None,
        "set" | "reset" if rest.starts_with("all") => SetKind::Clear { prepared: false },
        "set" | "reset" => SetKind::Record,
        "discard" if rest.starts_with("all") => SetKind::Clear { prepared: true },
        "prepare" => SetKind::Record,
        _ => SetKind::None,
    }
}

/// What the proxy knows about a COMMIT that is in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CommitTxid {
    /// The txid query's answer has not arrived yet: outcome cannot be resolved.
    Pending,
    /// No transaction id was assigned: the transaction wrote nothing.
    None,
    Some(u64),
    /// The commit could not be tagged (pipelined request): outcome cannot be resolved.
    Untracked,
    /// The proxy still held the COMMIT (waiting for the txid answer): it never reached the
    /// server, so the transaction cannot have committed.
    NotSent,
}

/// Bookkeeping of one client session.
#[derive(Debug)]
pub struct SessionState {
    /// Transaction status of the last ReadyForQuery forwarded to the client.
    pub status: u8,
    pub startup: Vec<(String, String)>,
    pub sets: Vec<String>,
    pending_sets: Vec<String>,
    /// Named prepared statements (their Parse frames) in creation order.
    pub prepared: Vec<(String, Frame)>,
    /// Statement name -> SQL text, for COMMIT detection in the extended protocol.
    stmt_sql: HashMap<String, String>,
    parse_queue: VecDeque<Option<(String, Frame)>>,
    pub unreplayable: Option<Unreplayable>,
    /// Client frames of unfinished request cycles, in order.
    pub inflight: Vec<Frame>,
    inflight_bytes: usize,
    /// ReadyForQuery messages the client still waits for.
    pub awaiting: u32,
    /// An extended-protocol cycle is open (messages since the last Sync).
    pub ext_open: bool,
    /// Status when the oldest in-flight cycle started.
    pub cycle_status: u8,
    /// A server byte of the current cycle has reached the client.
    pub forwarded_in_cycle: bool,
    pub commit: Option<CommitTxid>,
    /// Expected ReadyForQuery-terminated answers in wire order: `true` = an injected txid
    /// query (swallowed), `false` = the client's.
    expect: VecDeque<bool>,
    /// What the last txid answer said about the open block (`Some` is final once assigned).
    txid: Option<CommitTxid>,
    /// The last txid answer came after the client's last statement.
    txid_fresh: bool,
    /// The current cycle ends the block (COMMIT/ROLLBACK): no txid query after it.
    cycle_ends_block: bool,
    cycle_set: Option<String>,
    cycle_error: bool,
    pub overflow: bool,
}

/// What to do with a client frame.
#[derive(Debug, PartialEq, Eq)]
pub enum ClientAction {
    /// Forward. `inject_before`: send the txid query first; `hold`: keep this frame (and
    /// everything after it) back until every txid answer is in; `inject_after`: send the txid
    /// query right after this frame (pipelined: no extra round trip).
    Forward {
        inject_before: bool,
        hold: bool,
        inject_after: bool,
    },
    Terminate,
    /// Not a valid frontend message: reply with a protocol violation and close.
    Violation,
}

pub const TXID_QUERY: &str = "SELECT pg_current_xact_id_if_assigned()";

impl SessionState {
    pub fn new(startup: Vec<(String, String)>) -> Self {
        SessionState {
            status: b'I',
            startup,
            sets: Vec::new(),
            pending_sets: Vec::new(),
            prepared: Vec::new(),
            stmt_sql: HashMap::new(),
            parse_queue: VecDeque::new(),
            unreplayable: None,
            inflight: Vec::new(),
            inflight_bytes: 0,
            awaiting: 0,
            ext_open: false,
            cycle_status: b'I',
            forwarded_in_cycle: false,
            commit: None,
            expect: VecDeque::new(),
            txid: None,
            txid_fresh: false,
            cycle_ends_block: false,
            cycle_set: None,
            cycle_error: false,
            overflow: false,
        }
    }

    /// No request cycle is unfinished.
    pub fn idle(&self) -> bool {
        self.awaiting == 0 && !self.ext_open
    }

    fn mark(&mut self, u: Option<Unreplayable>) {
        if self.unreplayable.is_none() {
            self.unreplayable = u;
        }
    }

    /// Txid queries sent whose answers have not arrived.
    pub fn injected_outstanding(&self) -> usize {
        self.expect.iter().filter(|e| **e).count()
    }

    /// At the first frame of a cycle: returns (inject_before, hold) for a COMMIT of a block.
    fn start_cycle_if_idle(&mut self, first_sql: Option<&str>) -> (bool, bool) {
        if !self.idle() {
            if self.status == b'T' && first_sql.is_some_and(is_commit) {
                // Pipelined behind another request: cannot be tagged.
                self.commit = Some(CommitTxid::Untracked);
            }
            return (false, false);
        }
        self.cycle_status = self.status;
        self.forwarded_in_cycle = false;
        self.cycle_error = false;
        self.inflight.clear();
        self.inflight_bytes = 0;
        self.commit = None;
        self.cycle_ends_block = first_sql.is_some_and(|s| is_commit(s) || is_rollback(s));
        if self.status != b'T' || !first_sql.is_some_and(is_commit) {
            return (false, false);
        }
        // A COMMIT of an open block: its txid must be known before it may reach the server.
        match self.txid {
            Some(CommitTxid::Some(x)) => {
                self.commit = Some(CommitTxid::Some(x));
                (false, false)
            }
            _ if self.injected_outstanding() > 0 => {
                self.commit = Some(CommitTxid::Pending);
                (false, true)
            }
            Some(CommitTxid::None) if self.txid_fresh => {
                self.commit = Some(CommitTxid::None);
                (false, false)
            }
            _ => {
                self.commit = Some(CommitTxid::Pending);
                self.expect.push_back(true);
                (true, true)
            }
        }
    }

    /// After a cycle-ending frame inside a block whose txid is not known yet: ask for it.
    fn maybe_inject_after(&mut self, status_before: u8) -> bool {
        self.expect.push_back(false);
        self.txid_fresh = false;
        if status_before == b'T'
            && !self.cycle_ends_block
            && !matches!(self.txid, Some(CommitTxid::Some(_)))
        {
            self.expect.push_back(true);
            return true;
        }
        false
    }

    fn push_inflight(&mut self, f: &Frame) {
        self.inflight_bytes += f.body.len() + 5;
        if self.inflight_bytes > MAX_INFLIGHT_BYTES {
            // Too big to keep: a failure in this cycle is reported, not retried.
            self.overflow = true;
        } else {
            self.inflight.push(f.clone());
        }
    }

    /// Classifies a client frame and updates the state.
    pub fn on_client(&mut self, f: &Frame) -> ClientAction {
        match f.tag {
            b'X' => ClientAction::Terminate,
            b'Q' => {
                let sql = proto::cstr(&f.body).map(|(s, _)| s).unwrap_or("");
                let (inject_before, hold) = self.start_cycle_if_idle(Some(sql));
                self.mark(unreplayable_effect(sql));
                if set_kind(sql) != SetKind::None {
                    self.cycle_set = Some(sql.to_string());
                }
                self.push_inflight(f);
                self.awaiting += 1;
                let inject_after = self.maybe_inject_after(self.status);
                ClientAction::Forward {
                    inject_before,
                    hold,
                    inject_after,
                }
            }
            b'P' => {
                let Some((name, rest)) = proto::cstr(&f.body) else {
                    return ClientAction::Violation;
                };
                let Some((sql, _)) = proto::cstr(rest) else {
                    return ClientAction::Violation;
                };
                let (inject_before, hold) = self.start_cycle_if_idle(Some(sql));
                self.mark(unreplayable_effect(sql));
                if self.stmt_sql.len() < MAX_PREPARED || self.stmt_sql.contains_key(name) {
                    self.stmt_sql.insert(name.to_string(), sql.to_string());
                }
                let entry = (!name.is_empty()).then(|| (name.to_string(), f.clone()));
                self.parse_queue.push_back(entry);
                self.push_inflight(f);
                self.ext_open = true;
                ClientAction::Forward {
                    inject_before,
                    hold,
                    inject_after: false,
                }
            }
            b'B' => {
                let Some((_portal, rest)) = proto::cstr(&f.body) else {
                    return ClientAction::Violation;
                };
                let Some((stmt, _)) = proto::cstr(rest) else {
                    return ClientAction::Violation;
                };
                let sql = self.stmt_sql.get(stmt).cloned();
                let (inject_before, hold) = self.start_cycle_if_idle(sql.as_deref());
                // A SET sent with the extended protocol (pgJDBC sends every Statement.execute
                // that way) is session state too: recorded when its cycle ends without error.
                if let Some(q) = sql.as_deref().filter(|q| set_kind(q) != SetKind::None) {
                    self.cycle_set = Some(q.to_string());
                }
                self.push_inflight(f);
                self.ext_open = true;
                ClientAction::Forward {
                    inject_before,
                    hold,
                    inject_after: false,
                }
            }
            b'C' => {
                // Close statement: forget it for replay.
                if f.body.first() == Some(&b'S') {
                    if let Some((name, _)) = proto::cstr(&f.body[1..]) {
                        self.prepared.retain(|(n, _)| n != name);
                    }
                }
                self.start_cycle_if_idle(None);
                self.push_inflight(f);
                self.ext_open = true;
                ClientAction::Forward {
                    inject_before: false,
                    hold: false,
                    inject_after: false,
                }
            }
            b'E' | b'D' | b'H' => {
                self.start_cycle_if_idle(None);
                self.push_inflight(f);
                self.ext_open = true;
                ClientAction::Forward {
                    inject_before: false,
                    hold: false,
                    inject_after: false,
                }
            }
            b'S' => {
                self.start_cycle_if_idle(None);
                self.push_inflight(f);
                self.ext_open = false;
                self.awaiting += 1;
                let inject_after = self.maybe_inject_after(self.status);
                ClientAction::Forward {
                    inject_before: false,
                    hold: false,
                    inject_after,
                }
            }
            b'd' | b'c' | b'f' => {
                self.push_inflight(f);
                ClientAction::Forward {
                    inject_before: false,
                    hold: false,
                    inject_after: false,
                }
            }
            b'F' => {
                self.start_cycle_if_idle(None);
                self.push_inflight(f);
                self.awaiting += 1;
                self.expect.push_back(false);
                self.txid_fresh = false;
                ClientAction::Forward {
                    inject_before: false,
                    hold: false,
                    inject_after: false,
                }
            }
            _ => ClientAction::Violation,
        }
    }

    /// Handles a server frame; returns whether it goes to the client.
    pub fn on_server(&mut self, f: &Frame) -> bool {
        if self.expect.front() == Some(&true) {
            match f.tag {
                b'D' => {
                    if let Some(cols) = proto::data_row_columns(&f.body) {
                        let v = cols.into_iter().next().flatten();
                        let t = match v.and_then(|s| s.parse::<u64>().ok()) {
                            Some(x) => CommitTxid::Some(x),
                            None => CommitTxid::None,
                        };
                        self.txid = Some(t);
                        // Fresh if no client request was sent after this query.
                        self.txid_fresh = self.expect.iter().skip(1).all(|e| *e);
                        if self.commit == Some(CommitTxid::Pending) {
                            self.commit = Some(t);
                        }
                    }
                }
                b'Z' => {
                    self.expect.pop_front();
                }
                _ => {}
            }
            return false;
        }
        match f.tag {
            b'Z' => {
                self.expect.pop_front();
                self.status = f.body.first().copied().unwrap_or(b'I');
                if self.status == b'I' {
                    self.txid = None;
                    self.txid_fresh = false;
                }
                self.awaiting = self.awaiting.saturating_sub(1);
                if let Some(sql) = self.cycle_set.take() {
                    if !self.cycle_error {
                        match set_kind(&sql) {
                            SetKind::Record if self.status == b'I' => self.record_set(sql),
                            SetKind::Record => self.pending_sets.push(sql),
                            SetKind::Clear { prepared } => {
                                self.sets.clear();
                                self.pending_sets.clear();
                                if prepared {
                                    self.prepared.clear();
                                }
                            }
                            SetKind::None => {}
                        }
                    }
                }
                self.parse_queue.clear();
                self.cycle_error = false;
                if self.awaiting == 0 && !self.ext_open {
                    self.inflight.clear();
                    self.inflight_bytes = 0;
                    self.commit = None;
                    self.overflow = false;
                }
                self.cycle_status = self.status;
                self.forwarded_in_cycle = false;
            }
            b'1' => {
                if let Some(Some((name, frame))) = self.parse_queue.pop_front() {
                    self.prepared.retain(|(n, _)| *n != name);
                    if self.prepared.len() >= MAX_PREPARED {
                        self.mark(Some(Unreplayable::ReplayBound));
                    } else {
                        self.prepared.push((name, frame));
                    }
                }
                self.forwarded_in_cycle = true;
            }
            b'C' => {
                let tag = proto::cstr(&f.body).map(|(s, _)| s).unwrap_or("");
                if tag == "COMMIT" {
                    let p = std::mem::take(&mut self.pending_sets);
                    for s in p {
                        self.record_set(s);
                    }
                } else if tag == "ROLLBACK" {
                    self.pending_sets.clear();
                }
                self.forwarded_in_cycle = true;
            }
            b'E' => {
                self.cycle_error = true;
                self.forwarded_in_cycle = true;
            }
            b'G' | b'H' | b'W' => {
                // COPY cannot be replayed half-way.
                self.mark(Some(Unreplayable::Copy));
                self.forwarded_in_cycle = true;
            }
            b'N' | b'A' | b'S' => {}
            _ => self.forwarded_in_cycle = true,
        }
        true
    }

    fn record_set(&mut self, sql: String) {
        if self.sets.len() >= MAX_REPLAY_SETS {
            self.mark(Some(Unreplayable::ReplayBound));
        } else {
            self.sets.push(sql);
        }
    }

    /// The in-flight cycles are safe to resend to a new server: they started outside a
    /// transaction block, nothing reached the client yet, and every statement is idempotent.
    pub fn inflight_retryable(&self) -> bool {
        if self.cycle_status != b'I'
            || self.forwarded_in_cycle
            || self.overflow
            || self.inflight.is_empty()
        {
            return false;
        }
        self.inflight.iter().all(|f| match f.tag {
            b'Q' => proto::cstr(&f.body).is_some_and(|(s, _)| is_idempotent(s)),
            b'P' => proto::cstr(&f.body)
                .and_then(|(_, r)| proto::cstr(r))
                .is_some_and(|(s, _)| is_idempotent(s)),
            b'B' => proto::cstr(&f.body)
                .and_then(|(_, r)| proto::cstr(r))
                .is_some_and(|(stmt, _)| self.stmt_sql.get(stmt).is_some_and(|s| is_idempotent(s))),
            b'E' | b'D' | b'S' | b'H' | b'C' => true,
            _ => false,
        })
    }

    /// Frames that rebuild the replayable state on a fresh server connection (each SET as its
    /// own query, then all named Parse messages followed by one Sync).
    pub fn replay_frames(&self) -> Vec<Frame> {
        let mut v: Vec<Frame> = self.sets.iter().map(|s| proto::query(s)).collect();
        if !self.prepared.is_empty() {
            v.extend(self.prepared.iter().map(|(_, f)| f.clone()));
            v.push(Frame::new(b'S', Vec::new()));
        }
        v
    }

    /// The in-flight cycles were sent again to a new server (no txid queries among them).
    pub fn resent(&mut self) {
        self.expect = (0..self.awaiting).map(|_| false).collect();
        self.txid = None;
        self.txid_fresh = false;
    }

    /// After a move: the cycles were answered by the proxy, the session starts clean.
    pub fn reset_cycle(&mut self, status: u8) {
        self.status = status;
        self.cycle_status = status;
        self.awaiting = 0;
        self.inflight.clear();
        self.inflight_bytes = 0;
        self.commit = None;
        self.expect.clear();
        self.txid = None;
        self.txid_fresh = false;
        self.forwarded_in_cycle = false;
        self.parse_queue.clear();
        self.cycle_set = None;
        self.cycle_error = false;
        self.pending_sets.clear();
        self.overflow = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(name: &str, sql: &str) -> Frame {
        let mut b = Vec::new();
        proto::put_cstr(&mut b, name);
        proto::put_cstr(&mut b, sql);
        b.extend([0, 0]);
        Frame::new(b'P', b)
    }
    fn z(s: u8) -> Frame {
        proto::ready_for_query(s)
    }

    #[test]
    fn classifiers() {
        assert!(is_commit("COMMIT") && is_commit(" end;") && !is_commit("COMMIT PREPARED 'x'"));
        assert!(!is_commit("commitx") && is_rollback("ROLLBACK"));
        assert!(is_idempotent(
            "SELECT abalance FROM pgbench_accounts WHERE aid = $1"
        ));
        assert!(!is_idempotent("select nextval('s')") && !is_idempotent("select 1; delete from t"));
        assert!(is_idempotent("BEGIN;") && !is_idempotent("update t set a=1"));
        assert_eq!(
            unreplayable_effect("CREATE TEMP TABLE x(a int)"),
            Some(Unreplayable::TempTable)
        );
        assert_eq!(
            unreplayable_effect("select pg_advisory_lock(1)"),
            Some(Unreplayable::AdvisoryLock)
        );
        assert_eq!(unreplayable_effect("LISTEN ch"), Some(Unreplayable::Listen));
        assert_eq!(unreplayable_effect("select 1"), None);
        assert_eq!(set_kind("SET search_path = a"), SetKind::Record);
        assert_eq!(set_kind("set local x = 1"), SetKind::None);
        assert_eq!(set_kind("DISCARD ALL"), SetKind::Clear { prepared: true });
    }

    const PLAIN: ClientAction = ClientAction::Forward {
        inject_before: false,
        hold: false,
        inject_after: false,
    };

    fn txid_row(x: &str) -> Frame {
        let mut b = vec![0, 1];
        b.extend((x.len() as u32).to_be_bytes());
        b.extend(x.as_bytes());
        Frame::new(b'D', b)
    }

    #[test]
    fn txid_asked_after_first_statement_of_block_then_commit_goes_straight() {
        let mut s = SessionState::new(vec![]);
        assert_eq!(s.on_client(&proto::query("BEGIN")), PLAIN);
        s.on_server(&z(b'T'));
        assert_eq!(s.status, b'T');
        let a = s.on_client(&proto::query("UPDATE t SET a = 1"));
        assert_eq!(
            a,
            ClientAction::Forward {
                inject_before: false,
                hold: false,
                inject_after: true
            }
        );
        // The client's answer passes, the injected one is swallowed and read.
        assert!(s.on_server(&proto::command_complete("UPDATE 1")));
        assert!(s.on_server(&z(b'T')));
        assert!(!s.on_server(&txid_row("742")));
        assert!(!s.on_server(&z(b'T')));
        // Known txid: later statements are not followed by queries, COMMIT is not held.
        assert_eq!(s.on_client(&proto::query("SELECT 1")), PLAIN);
        s.on_server(&z(b'T'));
        assert_eq!(s.on_client(&proto::query("COMMIT")), PLAIN);
        assert_eq!(s.commit, Some(CommitTxid::Some(742)));
        assert!(s.on_server(&proto::command_complete("COMMIT")));
        assert!(s.on_server(&z(b'I')));
        assert!(s.idle() && s.commit.is_none());
    }

    #[test]
    fn commit_held_while_txid_answer_outstanding_or_unknown() {
        let mut s = SessionState::new(vec![]);
        s.on_client(&proto::query("BEGIN"));
        s.on_server(&z(b'T'));
        s.on_client(&proto::query("UPDATE t SET a = 1"));
        s.on_server(&z(b'T'));
        // The txid answer has not arrived: the COMMIT waits for it.
        assert_eq!(
            s.on_client(&proto::query("COMMIT")),
            ClientAction::Forward {
                inject_before: false,
                hold: true,
                inject_after: false
            }
        );
        assert_eq!(s.commit, Some(CommitTxid::Pending));
        assert_eq!(s.injected_outstanding(), 1);
        s.on_server(&txid_row("9"));
        s.on_server(&z(b'T'));
        assert_eq!(s.injected_outstanding(), 0);
        assert_eq!(s.commit, Some(CommitTxid::Some(9)));
        // A block opened inside a multi-statement query: nothing known, ask before COMMIT.
        let mut s = SessionState::new(vec![]);
        s.on_client(&proto::query("BEGIN; UPDATE t SET a = 2"));
        s.on_server(&z(b'T'));
        assert_eq!(
            s.on_client(&proto::query("COMMIT")),
            ClientAction::Forward {
                inject_before: true,
                hold: true,
                inject_after: false
            }
        );
    }

    #[test]
    fn sets_recorded_only_when_committed_or_outside_block() {
        let mut s = SessionState::new(vec![]);
        s.on_client(&proto::query("SET search_path = a"));
        s.on_server(&proto::command_complete("SET"));
        s.on_server(&z(b'I'));
        s.on_client(&proto::query("BEGIN"));
        s.on_server(&z(b'T'));
        s.on_client(&proto::query("SET application_name = 'x'"));
        s.on_server(&z(b'T'));
        s.on_client(&proto::query("ROLLBACK"));
        s.on_server(&proto::command_complete("ROLLBACK"));
        s.on_server(&z(b'I'));
        assert_eq!(s.sets, vec!["SET search_path = a".to_string()]);
        // A failing SET is not recorded.
        s.on_client(&proto::query("SET nope = 1"));
        s.on_server(&proto::error_response("ERROR", "42704", "x"));
        s.on_server(&z(b'I'));
        assert_eq!(s.sets.len(), 1);
    }

    #[test]
    fn sets_sent_with_the_extended_protocol_are_recorded() {
        // pgJDBC: Parse (unnamed) / Bind / Execute / Sync for `Statement.execute("SET ...")`.
        let mut s = SessionState::new(vec![]);
        s.on_client(&parse("", "SET search_path TO public, pg_catalog"));
        let mut bind = Vec::new();
        proto::put_cstr(&mut bind, "");
        proto::put_cstr(&mut bind, "");
        bind.extend([0, 0, 0, 0, 0, 0]);
        s.on_client(&Frame::new(b'B', bind));
        s.on_client(&Frame::new(b'E', vec![0, 0, 0, 0, 0]));
        s.on_client(&Frame::new(b'S', Vec::new()));
        s.on_server(&Frame::new(b'1', Vec::new()));
        s.on_server(&Frame::new(b'2', Vec::new()));
        s.on_server(&proto::command_complete("SET"));
        s.on_server(&z(b'I'));
        assert_eq!(
            s.sets,
            vec!["SET search_path TO public, pg_catalog".to_string()]
        );
    }

    #[test]
    fn prepared_statements_kept_on_parse_complete_and_extended_commit_detected() {
        let mut s = SessionState::new(vec![]);
        s.on_client(&parse("s1", "END"));
        s.on_client(&Frame::new(b'S', vec![]));
        s.on_server(&Frame::new(b'1', vec![]));
        s.on_server(&z(b'I'));
        assert_eq!(s.prepared.len(), 1);
        assert_eq!(s.replay_frames().len(), 2);
        s.on_client(&proto::query("BEGIN"));
        s.on_server(&z(b'T'));
        let mut b = Vec::new();
        proto::put_cstr(&mut b, "");
        proto::put_cstr(&mut b, "s1");
        b.extend([0, 0, 0, 0, 0, 0]);
        assert_eq!(
            s.on_client(&Frame::new(b'B', b)),
            ClientAction::Forward {
                inject_before: true,
                hold: true,
                inject_after: false
            }
        );
        assert_eq!(
            s.on_client(&Frame::new(b'Z', vec![])),
            ClientAction::Violation
        );
    }

    #[test]
    fn retryable_only_for_idempotent_autocommit_cycles() {
        let mut s = SessionState::new(vec![]);
        s.on_client(&proto::query("select abalance from t where aid = 3"));
        assert!(s.inflight_retryable());
        s.reset_cycle(b'I');
        s.on_client(&proto::query("update t set a = 1"));
        assert!(!s.inflight_retryable());
        s.reset_cycle(b'T');
        s.on_client(&proto::query("select 1"));
        assert!(!s.inflight_retryable(), "inside a block nothing is retried");
    }

    #[test]
    fn temp_table_marks_unreplayable() {
        let mut s = SessionState::new(vec![]);
        s.on_client(&proto::query("create temporary table t(a int)"));
        assert_eq!(s.unreplayable, Some(Unreplayable::TempTable));
    }
}

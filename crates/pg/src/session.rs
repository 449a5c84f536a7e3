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
    SetConfig,
    HoldCursor,
}

impl Unreplayable {
    pub fn what(self) -> &'static str {
        match self {
            Unreplayable::TempTable => "a temporary table",
            Unreplayable::AdvisoryLock => "a session advisory lock",
            Unreplayable::Listen => "LISTEN",
            Unreplayable::Copy => "an unfinished COPY",
            Unreplayable::ReplayBound => "more session state than the proxy keeps",
            Unreplayable::SetConfig => "a set_config() setting the proxy cannot replay",
            Unreplayable::HoldCursor => "a WITH HOLD cursor",
        }
    }
}

/// Text after leading whitespace and comments (`-- ...` lines, `/* ... */` blocks).
fn skip_comments(mut s: &str) -> &str {
    loop {
        s = s.trim_start();
        if let Some(r) = s.strip_prefix("--") {
            s = r.split_once('\n').map(|(_, r)| r).unwrap_or("");
        } else if s.starts_with("/*") {
            s = &s[comment_end(s.as_bytes(), 0)..];
        } else {
            return s;
        }
    }
}

/// Index just after the (nested) block comment starting at `i`.
fn comment_end(b: &[u8], mut i: usize) -> usize {
    let mut depth = 0;
    while i < b.len() {
        if b[i..].starts_with(b"/*") {
            depth += 1;
            i += 2;
        } else if b[i..].starts_with(b"*/") {
            depth -= 1;
            i += 2;
            if depth == 0 {
                return i;
            }
        } else {
            i += 1;
        }
    }
    b.len()
}

/// Lower-cased statement text without leading whitespace and comments.
fn norm(sql: &str) -> String {
    skip_comments(sql).to_ascii_lowercase()
}

/// First word of a statement.
fn first_word(n: &str) -> &str {
    n.split(|c: char| c.is_whitespace() || c == ';' || c == '(')
        .next()
        .unwrap_or("")
}

fn is_ident_byte(c: u8) -> bool {
    c.is_ascii_alphanumeric() || c == b'_' || c >= 0x80
}

/// Splits a simple-query string into its statements the way PostgreSQL's lexer does for `;`
/// (quoted strings and identifiers, `E''` escapes, dollar quotes and comments respected);
/// statements holding only whitespace and comments are dropped.
pub fn split_statements(sql: &str) -> Vec<&str> {
    let b = sql.as_bytes();
    let mut out = Vec::new();
    let (mut start, mut i) = (0, 0);
    fn push<'a>(sql: &'a str, from: usize, to: usize, out: &mut Vec<&'a str>) {
        let st = sql[from..to].trim();
        if !skip_comments(st).is_empty() {
            out.push(st);
        }
    }
    while i < b.len() {
        let c = b[i];
        match c {
            b'\'' => {
                let esc = i > 0
                    && (b[i - 1] == b'e' || b[i - 1] == b'E')
                    && (i < 2 || !is_ident_byte(b[i - 2]));
                i += 1;
                while i < b.len() {
                    if esc && b[i] == b'\\' {
                        i += 2;
                    } else if b[i] == b'\'' {
                        if b.get(i + 1) == Some(&b'\'') {
                            i += 2;
                        } else {
                            break;
                        }
                    } else {
                        i += 1;
                    }
                }
                i += 1;
            }
            b'"' => {
                i += 1;
                while i < b.len() {
                    if b[i] == b'"' {
                        if b.get(i + 1) == Some(&b'"') {
                            i += 2;
                            continue;
                        }
                        break;
                    }
                    i += 1;
                }
                i += 1;
            }
            b'$' if i == 0 || !is_ident_byte(b[i - 1]) => {
                // $tag$ ... $tag$ (a tag does not start with a digit: $1 is a parameter).
                let mut j = i + 1;
                while j < b.len() && is_ident_byte(b[j]) && !(j == i + 1 && b[j].is_ascii_digit()) {
                    j += 1;
                }
                if j < b.len() && b[j] == b'$' {
                    let tag = &b[i..=j];
                    let body = j + 1;
                    i = b[body..]
                        .windows(tag.len())
                        .position(|w| w == tag)
                        .map(|p| body + p + tag.len())
                        .unwrap_or(b.len());
                } else {
                    i += 1;
                }
            }
            b'-' if b.get(i + 1) == Some(&b'-') => {
                while i < b.len() && b[i] != b'\n' {
                    i += 1;
                }
            }
            b'/' if b.get(i + 1) == Some(&b'*') => i = comment_end(b, i),
            b';' => {
                push(sql, start, i, &mut out);
                i += 1;
                start = i;
            }
            _ => i += 1,
        }
    }
    push(sql, start.min(b.len()), b.len(), &mut out);
    out
}

/// Words of a normalized statement, split at whitespace, `;`, `(`, `)`, `,` and `=`.
fn words(n: &str) -> Vec<&str> {
    n.split(|c: char| c.is_whitespace() || matches!(c, ';' | '(' | ')' | ',' | '='))
        .filter(|w| !w.is_empty())
        .collect()
}

/// An SQL identifier as PostgreSQL folds it: `"X"` keeps its case, `X` is lower-cased.
fn ident(w: &str) -> String {
    match w.strip_prefix('"').and_then(|r| r.strip_suffix('"')) {
        Some(q) => q.replace("\"\"", "\""),
        None => w.to_ascii_lowercase(),
    }
}

/// What a statement does to the state a session must carry to a new server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Stmt {
    Other,
    /// BEGIN / START TRANSACTION.
    Begin,
    /// COMMIT / END [AND [NO] CHAIN] / PREPARE TRANSACTION: commits the block (its command
    /// tag says ROLLBACK when the block had failed).
    Commit,
    /// ROLLBACK / ABORT [AND [NO] CHAIN].
    Rollback,
    Savepoint(String),
    Release(String),
    RollbackTo(String),
    /// A session-level setting (SET, RESET name, `set_config(..., false)`): replayed by its
    /// own text; `key` names the setting (a later statement for the same key replaces it).
    Set {
        key: String,
        sql: String,
    },
    ResetAll,
    /// SET LOCAL / `set_config(..., true)`: nothing to replay, but a custom setting named for
    /// the first time becomes defined for the rest of the session (a placeholder).
    SetLocal {
        key: String,
    },
    /// SQL-level PREPARE (not transactional): the name and the statement that recreates it.
    Prepare {
        name: String,
        sql: String,
    },
    /// DEALLOCATE [PREPARE] name; `None` = ALL.
    Deallocate(Option<String>),
    DiscardAll,
    DeclareHold(String),
    /// CLOSE name; `None` = ALL.
    Close(Option<String>),
}

/// Classifies one statement (see `split_statements`).
pub fn classify(stmt: &str) -> Stmt {
    // Most statements (SELECT, INSERT, ...) change no session state: decide on the first
    // word before looking at (and lower-casing) the whole text.
    let head = skip_comments(stmt);
    let end = head
        .find(|c: char| !c.is_ascii_alphabetic())
        .unwrap_or(head.len());
    let w0 = head[..end].to_ascii_lowercase();
    const KEYWORDS: [&str; 16] = [
        "begin",
        "start",
        "commit",
        "end",
        "prepare",
        "rollback",
        "abort",
        "savepoint",
        "release",
        "deallocate",
        "discard",
        "declare",
        "close",
        "set",
        "reset",
        "select",
    ];
    if !KEYWORDS.contains(&w0.as_str()) {
        return Stmt::Other;
    }
    if w0 == "select" {
        return match set_config_call(stmt) {
            Some((key, false)) => Stmt::Set {
                key,
                sql: head.trim_end().trim_end_matches(';').trim_end().to_string(),
            },
            Some((key, true)) => Stmt::SetLocal { key },
            _ => Stmt::Other,
        };
    }
    let n = norm(stmt);
    let raw = skip_comments(stmt)
        .trim_end()
        .trim_end_matches(';')
        .trim_end();
    let w = words(&n);
    let at = |i: usize| w.get(i).copied().unwrap_or("");
    // Identifiers keep the case of the original text (quoted names are case-sensitive).
    let rw = words(raw);
    let name_at = |i: usize| rw.get(i).map(|x| ident(x)).unwrap_or_default();
    match at(0) {
        "begin" => Stmt::Begin,
        "start" if at(1) == "transaction" => Stmt::Begin,
        "commit" | "end" if at(1) != "prepared" => Stmt::Commit,
        "prepare" if at(1) == "transaction" => Stmt::Commit,
        "prepare" if !at(1).is_empty() => Stmt::Prepare {
            name: name_at(1),
            sql: raw.to_string(),
        },
        "rollback" | "abort" => {
            let mut i = 1;
            if matches!(at(i), "work" | "transaction") {
                i += 1;
            }
            match at(i) {
                "prepared" => Stmt::Other,
                "to" => {
                    i += 1;
                    if at(i) == "savepoint" {
                        i += 1;
                    }
                    Stmt::RollbackTo(name_at(i))
                }
                _ => Stmt::Rollback,
            }
        }
        "savepoint" => Stmt::Savepoint(name_at(1)),
        "release" => Stmt::Release(name_at(if at(1) == "savepoint" { 2 } else { 1 })),
        "deallocate" => {
            let i = if at(1) == "prepare" { 2 } else { 1 };
            if at(i) == "all" {
                Stmt::Deallocate(None)
            } else {
                Stmt::Deallocate(Some(name_at(i)))
            }
        }
        "discard" if at(1) == "all" => Stmt::DiscardAll,
        "declare" => {
            let upto = w.iter().position(|x| *x == "for").unwrap_or(w.len());
            let hold = w[..upto].windows(2).any(|p| p == ["with", "hold"]);
            if hold {
                Stmt::DeclareHold(name_at(1))
            } else {
                Stmt::Other
            }
        }
        "close" if at(1) == "all" => Stmt::Close(None),
        "close" => Stmt::Close(Some(name_at(1))),
        "set" => match set_key(&w[1..]) {
            Some(key) => Stmt::Set {
                key,
                sql: raw.to_string(),
            },
            None if at(1) == "local" => Stmt::SetLocal {
                key: setting_key(&w[2..]),
            },
            None => Stmt::Other,
        },
        "reset" if at(1) == "all" => Stmt::ResetAll,
        "reset" => Stmt::Set {
            key: setting_key(&w[1..]),
            sql: raw.to_string(),
        },
        _ => Stmt::Other,
    }
}

/// The setting a session-level SET changes (`None`: SET LOCAL, SET TRANSACTION, SET
/// CONSTRAINTS: they end with the transaction).
fn set_key(w: &[&str]) -> Option<String> {
    let at = |i: usize| w.get(i).copied().unwrap_or("");
    match at(0) {
        "local" | "transaction" | "constraints" => None,
        "session" if !matches!(at(1), "authorization" | "characteristics") => set_key(&w[1..]),
        _ => Some(setting_key(w)),
    }
}

/// A custom (placeholder) setting name as the parser folds it, `ext.name`: plain lower-case
/// identifier parts only, so it can be written back into `RESET` as is.
fn is_custom_setting(key: &str) -> bool {
    key.contains('.')
        && key.split('.').all(|p| {
            !p.is_empty()
                && p.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
        })
}

/// The setting named at the start of a SET/RESET (after SET [SESSION]).
fn setting_key(w: &[&str]) -> String {
    let at = |i: usize| w.get(i).copied().unwrap_or("");
    match (at(0), at(1)) {
        ("time", "zone") => "timezone".into(),
        ("schema", _) => "search_path".into(),
        ("names", _) => "client_encoding".into(),
        ("session", "authorization") => "session_authorization".into(),
        ("session", "characteristics") => "session_characteristics".into(),
        (k, _) => ident(k),
    }
}

/// A string literal `'...'` at the start of `s` (no `E''`): its value and the rest.
fn string_literal(s: &str) -> Option<(String, &str)> {
    let b = s.as_bytes();
    if b.first() != Some(&b'\'') {
        return None;
    }
    let mut v = String::new();
    let mut i = 1;
    while i < b.len() {
        if b[i] == b'\'' {
            if b.get(i + 1) == Some(&b'\'') {
                v.push('\'');
                i += 2;
                continue;
            }
            return Some((v, &s[i + 1..]));
        }
        let ch = s[i..].chars().next()?;
        v.push(ch);
        i += ch.len_utf8();
    }
    None
}

/// `SELECT set_config('name', 'value', false|true)` with literal arguments and nothing
/// else: the setting's name and `is_local`.
pub fn set_config_call(stmt: &str) -> Option<(String, bool)> {
    let s = skip_comments(stmt)
        .trim_end()
        .trim_end_matches(';')
        .trim_end();
    let kw = |s: &'static str| s.len();
    if !s.get(..6)?.eq_ignore_ascii_case("select") {
        return None;
    }
    let s = s[kw("select")..].trim_start();
    if !s.get(..10)?.eq_ignore_ascii_case("set_config") {
        return None;
    }
    let s = s[kw("set_config")..]
        .trim_start()
        .strip_prefix('(')?
        .trim_start();
    let (name, s) = string_literal(s)?;
    let s = s.trim_start().strip_prefix(',')?.trim_start();
    let (_value, s) = string_literal(s)?;
    let s = s.trim_start().strip_prefix(',')?.trim_start();
    let end = s
        .find(|c: char| !c.is_ascii_alphabetic())
        .unwrap_or(s.len());
    let local = match s[..end].to_ascii_lowercase().as_str() {
        "true" => true,
        "false" => false,
        _ => return None,
    };
    if s[end..].trim_start() != ")" {
        return None;
    }
    Some((name.to_ascii_lowercase(), local))
}

/// Every `set_config(...)` call in `n` (lower-cased) has the literal `true` as its last
/// argument: transaction-local like SET LOCAL, nothing to replay whatever the arguments.
fn set_config_all_local(n: &str) -> bool {
    n.match_indices("set_config").all(|(i, _)| {
        let rest = n[i + "set_config".len()..].trim_start();
        let Some(args) = rest.strip_prefix('(') else {
            return false;
        };
        let (mut depth, mut last_comma) = (0i32, None);
        for (j, c) in args.char_indices() {
            match c {
                '(' => depth += 1,
                ',' if depth == 0 => last_comma = Some(j),
                ')' if depth == 0 => {
                    return last_comma.is_some_and(|k| args[k + 1..j].trim() == "true");
                }
                ')' => depth -= 1,
                _ => {}
            }
        }
        false
    })
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
    if n.contains("set_config")
        && split_statements(sql).iter().any(|s| {
            let n = norm(s);
            n.contains("set_config") && set_config_call(s).is_none() && !set_config_all_local(&n)
        })
    {
        // Arguments the proxy cannot read (parameters, expressions) or a call inside a
        // larger statement: the value it set cannot be replayed.
        return Some(Unreplayable::SetConfig);
    }
    None
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

/// A pending effect on the session's settings inside a transaction.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Effect {
    Set { key: String, sql: String },
    ResetAll,
}

/// One level of the open transaction: the transaction itself (`name` None) or a savepoint.
#[derive(Debug, Default)]
struct Level {
    name: Option<String>,
    effects: Vec<Effect>,
}

/// Adds `e` to `list`, replacing what it supersedes (an earlier value of the same setting;
/// everything, for RESET ALL).
fn push_effect(list: &mut Vec<Effect>, e: Effect) {
    match &e {
        Effect::Set { key, .. } => {
            list.retain(|x| !matches!(x, Effect::Set { key: k, .. } if k == key))
        }
        Effect::ResetAll => list.clear(),
    }
    list.push(e);
}

/// What the server's next answers belong to, in wire order: a statement that will end with
/// CommandComplete (or an error), or the end of a request cycle (ReadyForQuery).
#[derive(Debug)]
enum Slot {
    Stmt(Stmt),
    /// A COMMIT (or the ROLLBACK sent for it) of a block a failover aborted: its ROLLBACK
    /// tag becomes the client's error.
    LostCommit(Stmt),
    Ready,
}

/// What to do with a server frame.
#[derive(Debug, PartialEq, Eq)]
pub enum ServerAction {
    Forward,
    /// An answer to the proxy's own query: not for the client.
    Swallow,
    /// Send this frame to the client instead.
    Replace(Frame),
}

impl ServerAction {
    pub fn forwarded(&self) -> bool {
        *self == ServerAction::Forward
    }
}

/// What the client is told when it commits a transaction a failover aborted.
pub const LOST_COMMIT_MESSAGE: &str = "pliant: the primary failed over; this transaction was aborted and cannot be committed (it was rolled back)";
/// What the client is told at its first statement in a transaction a failover aborted.
pub const LOST_BLOCK_MESSAGE: &str =
    "pliant: the primary failed over; the open transaction was aborted (roll back and retry)";

/// Bookkeeping of one client session.
#[derive(Debug)]
pub struct SessionState {
    /// Transaction status of the last ReadyForQuery forwarded to the client.
    pub status: u8,
    pub startup: Vec<(String, String)>,
    /// Committed session-level settings as (setting, statement), in replay order.
    pub sets: Vec<(String, String)>,
    /// Custom settings (`a.b`) this session defined: PostgreSQL keeps such a placeholder
    /// defined (value '' after RESET) for the session's life, whatever happened to the value
    /// or the transaction, so a replay defines it again (`RESET a.b`) before the settings.
    pub placeholders: Vec<String>,
    /// The open transaction (implicit or explicit) and its savepoints, with the settings
    /// changed in each; empty outside a transaction.
    levels: Vec<Level>,
    /// Prepared statements in creation order: the named Parse message of the extended
    /// protocol, or the Query of an SQL PREPARE (one namespace, as in PostgreSQL).
    pub prepared: Vec<(String, Frame)>,
    /// Open WITH HOLD cursors (they cannot be moved).
    hold_cursors: Vec<String>,
    /// Statement name -> SQL text, for COMMIT detection in the extended protocol.
    stmt_sql: HashMap<String, String>,
    /// Portal name -> SQL text of its statement.
    portal_sql: HashMap<String, String>,
    parse_queue: VecDeque<Option<(String, Frame)>>,
    slots: VecDeque<Slot>,
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
    cycle_error: bool,
    pub overflow: bool,
    /// The open block was aborted by a failover (the server session sits in a failed block).
    block_lost: bool,
    /// ... and the client has not been told yet.
    block_lost_unreported: bool,
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
    /// Send this frame to the server instead of the client's.
    Substitute(Frame),
    /// Answer the client without the server; with `skip_to_sync`, drop the client's
    /// messages up to the next Sync and answer that with ReadyForQuery.
    Reply {
        frames: Vec<Frame>,
        skip_to_sync: bool,
    },
    Terminate,
    /// Not a valid frontend message: reply with a protocol violation and close.
    Violation,
}

pub const TXID_QUERY: &str = "SELECT pg_current_xact_id_if_assigned()";

const PLAIN_FORWARD: ClientAction = ClientAction::Forward {
    inject_before: false,
    hold: false,
    inject_after: false,
};

impl SessionState {
    pub fn new(startup: Vec<(String, String)>) -> Self {
        SessionState {
            status: b'I',
            startup,
            sets: Vec::new(),
            placeholders: Vec::new(),
            levels: Vec::new(),
            prepared: Vec::new(),
            hold_cursors: Vec::new(),
            stmt_sql: HashMap::new(),
            portal_sql: HashMap::new(),
            parse_queue: VecDeque::new(),
            slots: VecDeque::new(),
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
            cycle_error: false,
            overflow: false,
            block_lost: false,
            block_lost_unreported: false,
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

    /// Why this session cannot be moved to a new server, if it cannot.
    pub fn unreplayable_reason(&self) -> Option<Unreplayable> {
        self.unreplayable
            .or((!self.hold_cursors.is_empty()).then_some(Unreplayable::HoldCursor))
    }

    /// Txid queries sent whose answers have not arrived.
    pub fn injected_outstanding(&self) -> usize {
        self.expect.iter().filter(|e| **e).count()
    }

    /// The session was moved to a new server and its open block is gone (RemusDB Lemma 2);
    /// the new server session was put into a failed block. `reported`: the client already
    /// got an error for it.
    pub fn block_aborted_by_failover(&mut self, reported: bool) {
        self.levels.clear();
        self.block_lost = true;
        self.block_lost_unreported = !reported;
    }

    /// The session moved to a new server between requests; returns whether it was inside a
    /// block, which is gone (the caller puts the new server session into a failed block).
    pub fn moved_between_requests(&mut self) -> bool {
        match self.status {
            b'T' => self.block_aborted_by_failover(false),
            // Already failed by its own error: it ends as it would have (COMMIT → ROLLBACK).
            b'E' => self.reset_cycle(b'E'),
            _ => return false,
        }
        true
    }

    /// At the first frame of a cycle: returns (inject_before, hold) for a COMMIT of a block.
    fn start_cycle_if_idle(&mut self, first_sql: Option<&str>) -> (bool, bool) {
        // A COMMIT of a block a failover aborted commits nothing: no txid to track.
        let commits = first_sql.is_some_and(is_commit) && !self.block_lost;
        if !self.idle() {
            if self.status == b'T' && commits {
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
        if self.status != b'T' || !commits {
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
        self.slots.push_back(Slot::Ready);
        self.txid_fresh = false;
        if status_before == b'T'
            && !self.cycle_ends_block
            && !self.block_lost
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

    /// SQL text of the statement a client frame runs or prepares, if the proxy knows it.
    fn frame_sql(&self, f: &Frame) -> Option<String> {
        match f.tag {
            b'Q' => proto::cstr(&f.body).map(|(s, _)| s.to_string()),
            b'P' => proto::cstr(&f.body)
                .and_then(|(_, r)| proto::cstr(r))
                .map(|(s, _)| s.to_string()),
            b'B' => proto::cstr(&f.body)
                .and_then(|(_, r)| proto::cstr(r))
                .and_then(|(stmt, _)| self.stmt_sql.get(stmt).cloned()),
            _ => None,
        }
    }

    /// The first client message after a failover aborted the block the client is idle in:
    /// anything but COMMIT/ROLLBACK fails with 40001 (the server session is in a failed
    /// block too, so what follows behaves as after any error inside a transaction).
    fn report_lost_block(&mut self, f: &Frame) -> Option<ClientAction> {
        if !self.block_lost_unreported || matches!(f.tag, b'X' | b'd' | b'c' | b'f') {
            return None;
        }
        self.block_lost_unreported = false;
        let first = self.frame_sql(f).map(|s| {
            let first = split_statements(&s).first().map(|x| classify(x));
            first.unwrap_or(Stmt::Other)
        });
        if matches!(first, Some(Stmt::Commit | Stmt::Rollback)) {
            return None;
        }
        self.status = b'E';
        let mut frames = vec![proto::error_response("ERROR", "40001", LOST_BLOCK_MESSAGE)];
        let answered = matches!(f.tag, b'Q' | b'S' | b'F');
        if answered {
            frames.push(proto::ready_for_query(b'E'));
        }
        Some(ClientAction::Reply {
            frames,
            skip_to_sync: !answered,
        })
    }

    /// Classifies a client frame and updates the state.
    pub fn on_client(&mut self, f: &Frame) -> ClientAction {
        if let Some(a) = self.report_lost_block(f) {
            return a;
        }
        match f.tag {
            b'X' => ClientAction::Terminate,
            b'Q' => {
                let sql = proto::cstr(&f.body).map(|(s, _)| s).unwrap_or("");
                let stmts: Vec<Stmt> = split_statements(sql).into_iter().map(classify).collect();
                if self.block_lost && stmts.first() == Some(&Stmt::Commit) {
                    // COMMIT of a block a failover aborted: roll it back and fail it (the
                    // rest of the query would not run after a failed COMMIT either).
                    let rb = proto::query("ROLLBACK");
                    self.start_cycle_if_idle(Some("ROLLBACK"));
                    self.slots.push_back(Slot::LostCommit(Stmt::Rollback));
                    self.push_inflight(&rb);
                    self.awaiting += 1;
                    self.maybe_inject_after(self.status);
                    return ClientAction::Substitute(rb);
                }
                let (inject_before, hold) = self.start_cycle_if_idle(Some(sql));
                self.mark(unreplayable_effect(sql));
                self.slots.extend(stmts.into_iter().map(Slot::Stmt));
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
                let Some((portal, rest)) = proto::cstr(&f.body) else {
                    return ClientAction::Violation;
                };
                let Some((stmt, _)) = proto::cstr(rest) else {
                    return ClientAction::Violation;
                };
                let sql = self.stmt_sql.get(stmt).cloned();
                let (inject_before, hold) = self.start_cycle_if_idle(sql.as_deref());
                if portal.is_empty() || self.portal_sql.len() < MAX_PREPARED {
                    self.portal_sql
                        .insert(portal.to_string(), sql.unwrap_or_default());
                }
                self.push_inflight(f);
                self.ext_open = true;
                ClientAction::Forward {
                    inject_before,
                    hold,
                    inject_after: false,
                }
            }
            b'E' => {
                self.start_cycle_if_idle(None);
                // The statement this Execute runs: a SET sent with the extended protocol
                // (pgJDBC sends every Statement.execute that way) is session state too.
                let sql = proto::cstr(&f.body)
                    .and_then(|(portal, _)| self.portal_sql.get(portal))
                    .map(|s| s.as_str())
                    .unwrap_or("");
                let st = split_statements(sql)
                    .first()
                    .map(|s| classify(s))
                    .unwrap_or(Stmt::Other);
                self.slots
                    .push_back(if self.block_lost && st == Stmt::Commit {
                        Slot::LostCommit(st)
                    } else {
                        Slot::Stmt(st)
                    });
                self.push_inflight(f);
                self.ext_open = true;
                PLAIN_FORWARD
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
                PLAIN_FORWARD
            }
            b'D' | b'H' => {
                self.start_cycle_if_idle(None);
                self.push_inflight(f);
                self.ext_open = true;
                PLAIN_FORWARD
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
                PLAIN_FORWARD
            }
            b'F' => {
                self.start_cycle_if_idle(None);
                self.push_inflight(f);
                self.awaiting += 1;
                self.expect.push_back(false);
                self.slots.push_back(Slot::Ready);
                self.txid_fresh = false;
                PLAIN_FORWARD
            }
            _ => ClientAction::Violation,
        }
    }

    /// Handles a server frame: whether (and as what) it goes to the client.
    pub fn on_server(&mut self, f: &Frame) -> ServerAction {
        self.on_server_raw(f.tag, &f.body)
    }

    /// `on_server` on a frame's tag and body as they lie in the receive buffer.
    pub fn on_server_raw(&mut self, tag: u8, body: &[u8]) -> ServerAction {
        if self.expect.front() == Some(&true) {
            match tag {
                b'D' => {
                    if let Some(cols) = proto::data_row_columns(body) {
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
            return ServerAction::Swallow;
        }
        match tag {
            b'Z' => {
                self.expect.pop_front();
                // Statements skipped after an error, then the cycle's end.
                while let Some(Slot::Stmt(_) | Slot::LostCommit(_)) = self.slots.front() {
                    self.slots.pop_front();
                }
                self.slots.pop_front();
                self.status = body.first().copied().unwrap_or(b'I');
                if self.status == b'I' {
                    self.txid = None;
                    self.txid_fresh = false;
                    self.block_lost = false;
                    self.block_lost_unreported = false;
                    // An implicit transaction (a query or pipeline outside a block) ends.
                    let levels = std::mem::take(&mut self.levels);
                    if !self.cycle_error {
                        self.commit_levels(levels);
                    }
                }
                self.awaiting = self.awaiting.saturating_sub(1);
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
                    self.add_prepared(name, frame);
                }
                self.forwarded_in_cycle = true;
            }
            b'C' => {
                self.forwarded_in_cycle = true;
                let tag = proto::cstr(body).map(|(s, _)| s).unwrap_or("");
                let slot = match self.slots.front() {
                    Some(Slot::Stmt(_) | Slot::LostCommit(_)) => self.slots.pop_front(),
                    _ => None,
                };
                let lost_commit = matches!(slot, Some(Slot::LostCommit(_)));
                if let Some(Slot::Stmt(st) | Slot::LostCommit(st)) = slot {
                    self.apply(st, tag);
                }
                if lost_commit && tag == "ROLLBACK" {
                    self.cycle_error = true;
                    return ServerAction::Replace(proto::error_response(
                        "ERROR",
                        "40001",
                        LOST_COMMIT_MESSAGE,
                    ));
                }
            }
            b's' | b'I' => {
                // PortalSuspended / EmptyQueryResponse: the Execute ended without effect.
                if let Some(Slot::Stmt(_) | Slot::LostCommit(_)) = self.slots.front() {
                    self.slots.pop_front();
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
        ServerAction::Forward
    }

    /// Records a custom setting the server just accepted (see `placeholders`).
    fn define_placeholder(&mut self, key: &str) {
        if !is_custom_setting(key) || self.placeholders.iter().any(|p| p == key) {
            return;
        }
        if self.placeholders.len() >= MAX_REPLAY_SETS {
            self.mark(Some(Unreplayable::ReplayBound));
        } else {
            self.placeholders.push(key.to_string());
        }
    }

    fn add_prepared(&mut self, name: String, frame: Frame) {
        self.prepared.retain(|(n, _)| *n != name);
        if self.prepared.len() >= MAX_PREPARED {
            self.mark(Some(Unreplayable::ReplayBound));
        } else {
            self.prepared.push((name, frame));
        }
    }

    /// Applies the effect of a statement the server completed with command tag `tag`.
    fn apply(&mut self, st: Stmt, tag: &str) {
        match st {
            Stmt::Begin => {
                if self.levels.is_empty() {
                    self.levels.push(Level::default());
                }
            }
            // The tag says what happened: COMMIT (or PREPARE TRANSACTION) keeps the
            // settings, ROLLBACK (a COMMIT of a failed block) drops them.
            Stmt::Commit if tag != "ROLLBACK" => {
                let levels = std::mem::take(&mut self.levels);
                self.commit_levels(levels);
            }
            Stmt::Commit | Stmt::Rollback => self.levels.clear(),
            Stmt::Savepoint(name) => {
                if self.levels.is_empty() {
                    self.levels.push(Level::default());
                }
                self.levels.push(Level {
                    name: Some(name),
                    effects: Vec::new(),
                });
            }
            Stmt::Release(name) => {
                if let Some(i) = self.savepoint(&name) {
                    // RELEASE merges the savepoint (and those after it) into its parent.
                    for l in self.levels.split_off(i) {
                        for e in l.effects {
                            push_effect(&mut self.levels[i - 1].effects, e);
                        }
                    }
                }
            }
            Stmt::RollbackTo(name) => {
                if let Some(i) = self.savepoint(&name) {
                    // Undoes what followed the savepoint; the savepoint itself stays.
                    self.levels.truncate(i + 1);
                    self.levels[i].effects.clear();
                }
            }
            Stmt::Set { key, sql } => {
                self.define_placeholder(&key);
                self.push_pending(Effect::Set { key, sql })
            }
            Stmt::SetLocal { key } => self.define_placeholder(&key),
            Stmt::ResetAll => self.push_pending(Effect::ResetAll),
            // Prepared statements are not transactional: they exist once PREPARE completed.
            Stmt::Prepare { name, sql } => self.add_prepared(name, proto::query(&sql)),
            Stmt::Deallocate(Some(name)) => self.prepared.retain(|(n, _)| *n != name),
            Stmt::Deallocate(None) => self.prepared.clear(),
            Stmt::DiscardAll => {
                // RESET ALL, DEALLOCATE ALL, CLOSE ALL, UNLISTEN *, advisory unlock, DISCARD
                // TEMP: nothing left that could not move (except an unfinished COPY).
                self.sets.clear();
                self.levels.clear();
                self.prepared.clear();
                self.hold_cursors.clear();
                if self.unreplayable != Some(Unreplayable::Copy) {
                    self.unreplayable = None;
                }
            }
            Stmt::DeclareHold(name) => {
                if self.hold_cursors.len() < MAX_PREPARED {
                    self.hold_cursors.push(name);
                }
            }
            Stmt::Close(Some(name)) => self.hold_cursors.retain(|n| *n != name),
            Stmt::Close(None) => self.hold_cursors.clear(),
            Stmt::Other => {}
        }
    }

    /// Innermost level (transaction = 0) of the savepoint `name`; PostgreSQL picks the most
    /// recent one of that name.
    fn savepoint(&self, name: &str) -> Option<usize> {
        self.levels
            .iter()
            .rposition(|l| l.name.as_deref() == Some(name))
            .filter(|i| *i > 0)
    }

    fn push_pending(&mut self, e: Effect) {
        if self.levels.is_empty() {
            // Outside a block: an implicit transaction, ended at ReadyForQuery.
            self.levels.push(Level::default());
        }
        let top = self.levels.len() - 1;
        push_effect(&mut self.levels[top].effects, e);
    }

    /// The transaction committed: its settings become the session's.
    fn commit_levels(&mut self, levels: Vec<Level>) {
        for e in levels.into_iter().flat_map(|l| l.effects) {
            match e {
                Effect::ResetAll => self.sets.clear(),
                Effect::Set { key, sql } => {
                    self.sets.retain(|(k, _)| *k != key);
                    if self.sets.len() >= MAX_REPLAY_SETS {
                        self.mark(Some(Unreplayable::ReplayBound));
                    } else {
                        self.sets.push((key, sql));
                    }
                }
            }
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
            b'Q' | b'P' | b'B' => self.frame_sql(f).is_some_and(|s| is_idempotent(&s)),
            b'E' | b'D' | b'S' | b'H' | b'C' => true,
            _ => false,
        })
    }

    /// Frames that rebuild the replayable state on a fresh server connection (each setting
    /// and each SQL PREPARE as its own query, then all named Parse messages followed by one
    /// Sync), and the number of ReadyForQuery messages they are answered with.
    pub fn replay_frames(&self) -> (Vec<Frame>, usize) {
        let mut v: Vec<Frame> = self
            .placeholders
            .iter()
            .map(|p| proto::query(&format!("RESET {p}")))
            .collect();
        v.extend(self.sets.iter().map(|(_, s)| proto::query(s)));
        let (parses, queries): (Vec<&Frame>, Vec<&Frame>) = self
            .prepared
            .iter()
            .map(|(_, f)| f)
            .partition(|f| f.tag == b'P');
        v.extend(queries.into_iter().cloned());
        let mut zs = v.len();
        if !parses.is_empty() {
            v.extend(parses.into_iter().cloned());
            v.push(Frame::new(b'S', Vec::new()));
            zs += 1;
        }
        (v, zs)
    }

    /// Names of the prepared statements a replay recreates.
    pub fn prepared_names(&self) -> Vec<&str> {
        self.prepared.iter().map(|(n, _)| n.as_str()).collect()
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
        self.slots.clear();
        self.txid = None;
        self.txid_fresh = false;
        self.forwarded_in_cycle = false;
        self.parse_queue.clear();
        self.cycle_error = false;
        self.levels.clear();
        self.overflow = false;
    }
}

#[cfg(test)]
mod model;

#[cfg(test)]
mod tests {
    use super::*;

    /// A Parse message (no parameter types).
    pub(super) fn parse(name: &str, sql: &str) -> Frame {
        let mut b = Vec::new();
        proto::put_cstr(&mut b, name);
        proto::put_cstr(&mut b, sql);
        b.extend([0, 0]);
        Frame::new(b'P', b)
    }
    fn z(s: u8) -> Frame {
        proto::ready_for_query(s)
    }
    fn sql_of(s: &SessionState) -> Vec<&str> {
        s.sets.iter().map(|(_, q)| q.as_str()).collect()
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
        assert_eq!(
            classify("SET search_path = a"),
            Stmt::Set {
                key: "search_path".into(),
                sql: "SET search_path = a".into()
            }
        );
        // Local settings replay nothing but may define a placeholder.
        assert_eq!(
            classify("set local x.y = 1"),
            Stmt::SetLocal { key: "x.y".into() }
        );
        assert_eq!(classify("DISCARD ALL"), Stmt::DiscardAll);
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
        assert!(s
            .on_server(&proto::command_complete("UPDATE 1"))
            .forwarded());
        assert!(s.on_server(&z(b'T')).forwarded());
        assert!(!s.on_server(&txid_row("742")).forwarded());
        assert!(!s.on_server(&z(b'T')).forwarded());
        // Known txid: later statements are not followed by queries, COMMIT is not held.
        assert_eq!(s.on_client(&proto::query("SELECT 1")), PLAIN);
        s.on_server(&z(b'T'));
        assert_eq!(s.on_client(&proto::query("COMMIT")), PLAIN);
        assert_eq!(s.commit, Some(CommitTxid::Some(742)));
        assert!(s.on_server(&proto::command_complete("COMMIT")).forwarded());
        assert!(s.on_server(&z(b'I')).forwarded());
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
        assert_eq!(sql_of(&s), vec!["SET search_path = a"]);
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
        assert_eq!(sql_of(&s), vec!["SET search_path TO public, pg_catalog"]);
    }

    #[test]
    fn prepared_statements_kept_on_parse_complete_and_extended_commit_detected() {
        let mut s = SessionState::new(vec![]);
        s.on_client(&parse("s1", "END"));
        s.on_client(&Frame::new(b'S', vec![]));
        s.on_server(&Frame::new(b'1', vec![]));
        s.on_server(&z(b'I'));
        assert_eq!(s.prepared.len(), 1);
        assert_eq!(s.replay_frames().0.len(), 2);
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

    /// One request through the state machine with the server's `answers` (txid queries the
    /// state injects are answered too); returns what the client receives.
    fn exchange(s: &mut SessionState, f: Frame, answers: &[Frame]) -> Vec<Frame> {
        let txid_answer = |st: u8| {
            if st == b'E' {
                vec![proto::error_response("ERROR", "25P02", "aborted"), z(b'E')]
            } else {
                vec![txid_row("7"), proto::command_complete("SELECT 1"), z(st)]
            }
        };
        let status = s.status;
        let (before, after) = match s.on_client(&f) {
            ClientAction::Forward {
                inject_before,
                inject_after,
                ..
            } => (inject_before, inject_after),
            ClientAction::Substitute(_) => (false, false),
            ClientAction::Reply { frames, .. } => return frames,
            a => panic!("unexpected {a:?}"),
        };
        let mut server = Vec::new();
        if before {
            server.extend(txid_answer(status));
        }
        server.extend(answers.iter().cloned());
        if after {
            let end = answers.last().and_then(|f| f.body.first().copied());
            server.extend(txid_answer(end.unwrap_or(b'I')));
        }
        let mut out = Vec::new();
        for f in &server {
            match s.on_server(f) {
                ServerAction::Forward => out.push(f.clone()),
                ServerAction::Replace(g) => out.push(g),
                ServerAction::Swallow => {}
            }
        }
        out
    }

    /// A simple query answered with one CommandComplete per tag, then ReadyForQuery.
    fn q(s: &mut SessionState, sql: &str, tags: &[&str], status: u8) -> Vec<Frame> {
        let mut a: Vec<Frame> = tags.iter().map(|t| proto::command_complete(t)).collect();
        a.push(z(status));
        exchange(s, proto::query(sql), &a)
    }

    /// Single-statement queries, each answered with its tag and status.
    fn script(s: &mut SessionState, steps: &[(&str, &str, u8)]) {
        for (sql, tag, status) in steps {
            q(s, sql, &[tag], *status);
        }
    }

    /// BEGIN; `sql` (answered with `tag`); then `end` (COMMIT or ROLLBACK).
    fn txn(s: &mut SessionState, sql: &str, tag: &str, end: &str) {
        q(s, "BEGIN", &["BEGIN"], b'T');
        q(s, sql, &[tag], b'T');
        q(s, end, &[end], b'I');
    }

    fn codes(frames: &[Frame]) -> Vec<String> {
        frames
            .iter()
            .filter(|f| f.tag == b'E')
            .map(|f| proto::error_field(&f.body, b'C').unwrap_or_default())
            .collect()
    }

    fn tags(frames: &[Frame]) -> Vec<String> {
        frames
            .iter()
            .filter(|f| f.tag == b'C')
            .map(|f| {
                proto::cstr(&f.body)
                    .map(|(t, _)| t.to_string())
                    .unwrap_or_default()
            })
            .collect()
    }

    #[test]
    fn statements_are_split_like_postgres_lexes_them() {
        assert_eq!(
            split_statements(
                "SET a = 'x;y'; SELECT $$;$$ ; -- c;\n /* a; /* b; */ */ ;PREPARE p AS SELECT E'\\';'"
            ),
            vec![
                "SET a = 'x;y'",
                "SELECT $$;$$",
                "-- c;\n /* a; /* b; */ */",
                "PREPARE p AS SELECT E'\\';'"
            ]
            .into_iter()
            .filter(|x| !x.starts_with("--"))
            .collect::<Vec<_>>()
        );
        assert_eq!(
            split_statements(" ; -- only a comment\n"),
            Vec::<&str>::new()
        );
        assert_eq!(
            split_statements("select \"a;b\"; select $1"),
            vec!["select \"a;b\"", "select $1"]
        );
        assert_eq!(
            split_statements("SET x = 1; /* c */ SELECT $t$ a;b $t$"),
            vec!["SET x = 1", "/* c */ SELECT $t$ a;b $t$"]
        );
        assert_eq!(
            classify("/* c */ SET x = 1"),
            Stmt::Set {
                key: "x".into(),
                sql: "SET x = 1".into()
            }
        );
        assert_eq!(
            classify("ROLLBACK TO SAVEPOINT \"Sp\""),
            Stmt::RollbackTo("Sp".into())
        );
        assert_eq!(
            classify("rollback work to sp"),
            Stmt::RollbackTo("sp".into())
        );
        assert_eq!(classify("RELEASE Sp"), Stmt::Release("sp".into()));
        assert_eq!(classify("COMMIT AND CHAIN"), Stmt::Commit);
        assert_eq!(classify("PREPARE TRANSACTION 'x'"), Stmt::Commit);
        assert_eq!(classify("COMMIT PREPARED 'x'"), Stmt::Other);
        assert_eq!(
            classify("DEALLOCATE PREPARE q"),
            Stmt::Deallocate(Some("q".into()))
        );
        assert_eq!(classify("deallocate all"), Stmt::Deallocate(None));
        assert_eq!(classify("DISCARD PLANS"), Stmt::Other);
        assert_eq!(
            classify("DECLARE c NO SCROLL CURSOR WITH HOLD FOR SELECT 1"),
            Stmt::DeclareHold("c".into())
        );
        assert_eq!(
            classify("DECLARE c CURSOR FOR SELECT 'with hold'"),
            Stmt::Other
        );
        assert_eq!(
            classify("SET SESSION TIME ZONE 'UTC'"),
            Stmt::Set {
                key: "timezone".into(),
                sql: "SET SESSION TIME ZONE 'UTC'".into()
            }
        );
        assert_eq!(
            classify("SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY"),
            Stmt::Set {
                key: "session_characteristics".into(),
                sql: "SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY".into()
            }
        );
        assert_eq!(classify("SET TRANSACTION READ ONLY"), Stmt::Other);
    }

    #[test]
    fn set_config_false_is_a_setting_true_is_local_and_unreadable_arguments_unreplayable() {
        let sql = "SELECT set_config('myapp.tenant', 'x', false)";
        assert_eq!(set_config_call(sql), Some(("myapp.tenant".into(), false)));
        assert_eq!(
            set_config_call("select set_config ( 'a.b' , 'it''s' , TRUE );"),
            Some(("a.b".into(), true))
        );
        assert_eq!(set_config_call("SELECT set_config('a.b', $1, false)"), None);
        let mut s = SessionState::new(vec![]);
        q(&mut s, sql, &["SELECT 1"], b'I');
        assert_eq!(sql_of(&s), vec![sql]);
        // Transaction-local: nothing to replay, whatever the arguments.
        q(
            &mut s,
            "SELECT set_config('myapp.user', 'u', true)",
            &["SELECT 1"],
            b'I',
        );
        assert_eq!(
            unreplayable_effect("SELECT set_config('a.b', $1, true)"),
            None
        );
        assert_eq!(sql_of(&s), vec![sql]);
        assert_eq!(s.unreplayable_reason(), None);
        // Rolled back with its transaction like SET.
        txn(
            &mut s,
            "SELECT set_config('myapp.tenant', 'y', false)",
            "SELECT 1",
            "ROLLBACK",
        );
        assert_eq!(sql_of(&s), vec![sql]);
        // A value the proxy cannot read: the session cannot move (57P01 at failover).
        for bad in [
            "SELECT set_config('myapp.tenant', $1, false)",
            "SELECT set_config('myapp.tenant', current_user, false)",
            "SELECT 1, set_config('myapp.tenant', 'x', false)",
        ] {
            assert_eq!(
                unreplayable_effect(bad),
                Some(Unreplayable::SetConfig),
                "{bad}"
            );
        }
        let mut s = SessionState::new(vec![]);
        s.on_client(&parse("", "SELECT set_config('myapp.tenant', $1, false)"));
        assert_eq!(s.unreplayable_reason(), Some(Unreplayable::SetConfig));
    }

    #[test]
    fn savepoints_keep_what_came_before_and_undo_what_came_after() {
        // SET; SAVEPOINT; ROLLBACK TO; COMMIT keeps the SET (the ROLLBACK tag of ROLLBACK TO
        // is not the end of the transaction).
        let mut s = SessionState::new(vec![]);
        script(
            &mut s,
            &[
                ("BEGIN", "BEGIN", b'T'),
                ("SET search_path = a", "SET", b'T'),
                ("SAVEPOINT sp", "SAVEPOINT", b'T'),
                ("SET work_mem = '8MB'", "SET", b'T'),
                ("ROLLBACK TO SAVEPOINT sp", "ROLLBACK", b'T'),
                ("COMMIT", "COMMIT", b'I'),
            ],
        );
        assert_eq!(sql_of(&s), vec!["SET search_path = a"]);
        // RELEASE merges into the parent; a later ROLLBACK TO an outer savepoint undoes it.
        q(
            &mut s,
            "BEGIN; SAVEPOINT a; SET x.y = 1; SAVEPOINT b; SET x.z = 2; RELEASE b",
            &["BEGIN", "SAVEPOINT", "SET", "SAVEPOINT", "SET", "RELEASE"],
            b'T',
        );
        q(
            &mut s,
            "SAVEPOINT c; SET x.w = 3; RELEASE SAVEPOINT c; ROLLBACK TO a; SET x.v = 4",
            &["SAVEPOINT", "SET", "RELEASE", "ROLLBACK", "SET"],
            b'T',
        );
        q(&mut s, "END", &["COMMIT"], b'I');
        assert_eq!(sql_of(&s), vec!["SET search_path = a", "SET x.v = 4"]);
        // An error fails the block; ROLLBACK TO recovers it, COMMIT keeps the rest.
        q(
            &mut s,
            "BEGIN; SET x.a = 1; SAVEPOINT s",
            &["BEGIN", "SET", "SAVEPOINT"],
            b'T',
        );
        let mut a = vec![proto::command_complete("SET")];
        a.push(proto::error_response("ERROR", "22012", "division by zero"));
        a.push(z(b'E'));
        exchange(&mut s, proto::query("SET x.b = 2; SELECT 1/0"), &a);
        q(&mut s, "ROLLBACK TO s", &["ROLLBACK"], b'T');
        q(&mut s, "COMMIT", &["COMMIT"], b'I');
        assert_eq!(
            sql_of(&s),
            vec!["SET search_path = a", "SET x.v = 4", "SET x.a = 1"]
        );
        // A later SET of the same setting replaces the earlier one; RESET ALL clears.
        q(&mut s, "SET search_path = b", &["SET"], b'I');
        assert_eq!(
            sql_of(&s),
            vec!["SET x.v = 4", "SET x.a = 1", "SET search_path = b"]
        );
        q(
            &mut s,
            "BEGIN; RESET ALL; SET x.q = 1; ROLLBACK",
            &["BEGIN", "RESET", "SET", "ROLLBACK"],
            b'I',
        );
        assert_eq!(sql_of(&s).len(), 3);
        q(&mut s, "RESET ALL; SET x.q = 1", &["RESET", "SET"], b'I');
        assert_eq!(sql_of(&s), vec!["SET x.q = 1"]);
        // An error later in a multi-statement query rolls its implicit transaction back.
        let a = [
            proto::command_complete("SET"),
            proto::error_response("ERROR", "22012", "division by zero"),
            z(b'I'),
        ];
        exchange(&mut s, proto::query("SET x.r = 1; SELECT 1/0"), &a);
        assert_eq!(sql_of(&s), vec!["SET x.q = 1"]);
    }

    #[test]
    fn prepared_statements_follow_prepare_deallocate_discard_and_close() {
        let mut s = SessionState::new(vec![]);
        // (One query with three statements: each completes on its own.)
        q(
            &mut s,
            "PREPARE q AS SELECT 1; DEALLOCATE q; PREPARE q AS SELECT 2",
            &["PREPARE", "DEALLOCATE", "PREPARE"],
            b'I',
        );
        assert_eq!(s.prepared_names(), vec!["q"]);
        let (frames, zs) = s.replay_frames();
        assert_eq!(
            (frames, zs),
            (vec![proto::query("PREPARE q AS SELECT 2")], 1)
        );
        // Not transactional: a PREPARE in a rolled-back block survives, so does a DEALLOCATE.
        q(&mut s, "BEGIN", &["BEGIN"], b'T');
        q(&mut s, "PREPARE r (int) AS SELECT $1", &["PREPARE"], b'T');
        q(&mut s, "DEALLOCATE PREPARE q", &["DEALLOCATE"], b'T');
        q(&mut s, "ROLLBACK", &["ROLLBACK"], b'I');
        assert_eq!(s.prepared_names(), vec!["r"]);
        // Protocol-level statements share the namespace.
        s.on_client(&parse("s1", "SELECT 1"));
        s.on_client(&Frame::new(b'S', vec![]));
        s.on_server(&Frame::new(b'1', vec![]));
        s.on_server(&z(b'I'));
        assert_eq!(s.prepared_names(), vec!["r", "s1"]);
        let (frames, zs) = s.replay_frames();
        assert_eq!((frames.len(), zs), (3, 2), "PREPARE r; Parse s1; Sync");
        q(&mut s, "DEALLOCATE s1", &["DEALLOCATE"], b'I');
        assert_eq!(s.prepared_names(), vec!["r"]);
        q(&mut s, "DISCARD PLANS", &["DISCARD PLANS"], b'I');
        assert_eq!(s.prepared_names(), vec!["r"]);
        q(&mut s, "DEALLOCATE ALL", &["DEALLOCATE ALL"], b'I');
        assert!(s.prepared.is_empty());
        q(
            &mut s,
            "SET a.b = 1; PREPARE q AS SELECT 1",
            &["SET", "PREPARE"],
            b'I',
        );
        // A failed PREPARE (the name exists) keeps the original.
        let a = [proto::error_response("ERROR", "42P05", "exists"), z(b'I')];
        exchange(&mut s, proto::query("PREPARE q AS SELECT 3"), &a);
        // (Frame 0 defines the placeholder a.b, frame 1 sets it.)
        assert_eq!(s.replay_frames().0[0], proto::query("RESET a.b"));
        assert_eq!(
            s.replay_frames().0[2],
            proto::query("PREPARE q AS SELECT 1")
        );
        // A failed query still keeps a PREPARE that completed before the error.
        let a = [
            proto::command_complete("PREPARE"),
            proto::error_response("ERROR", "22012", "division by zero"),
            z(b'I'),
        ];
        exchange(
            &mut s,
            proto::query("PREPARE w AS SELECT 1; SELECT 1/0"),
            &a,
        );
        assert_eq!(s.prepared_names(), vec!["q", "w"]);
        q(&mut s, "DISCARD ALL", &["DISCARD ALL"], b'I');
        assert!(s.prepared.is_empty() && s.sets.is_empty());
    }

    #[test]
    fn with_hold_cursor_makes_the_session_unmovable_until_closed() {
        let mut s = SessionState::new(vec![]);
        txn(
            &mut s,
            "DECLARE c CURSOR WITH HOLD FOR SELECT 1",
            "DECLARE CURSOR",
            "COMMIT",
        );
        assert_eq!(s.unreplayable_reason(), Some(Unreplayable::HoldCursor));
        assert!(Unreplayable::HoldCursor.what().contains("WITH HOLD"));
        q(&mut s, "CLOSE c", &["CLOSE CURSOR"], b'I');
        assert_eq!(s.unreplayable_reason(), None);
        q(
            &mut s,
            "DECLARE d CURSOR WITH HOLD FOR SELECT 1",
            &["DECLARE CURSOR"],
            b'I',
        );
        q(
            &mut s,
            "CREATE TEMP TABLE t(a int)",
            &["CREATE TABLE"],
            b'I',
        );
        assert_eq!(s.unreplayable_reason(), Some(Unreplayable::TempTable));
        // DISCARD ALL drops both.
        q(&mut s, "DISCARD ALL", &["DISCARD ALL"], b'I');
        assert_eq!(s.unreplayable_reason(), None);
    }

    fn commit_after_failover_fails(commit: &str, reported_first: bool) {
        let mut s = SessionState::new(vec![]);
        q(&mut s, "SET a.b = 1", &["SET"], b'I');
        q(&mut s, "BEGIN", &["BEGIN"], b'T');
        q(&mut s, "SET a.c = 1", &["SET"], b'T');
        q(&mut s, "INSERT INTO t VALUES (1)", &["INSERT 0 1"], b'T');
        // Failover while idle in the block; the new server session is in a failed block.
        s.block_aborted_by_failover(false);
        if reported_first {
            let out = exchange(&mut s, proto::query("INSERT INTO t VALUES (2)"), &[]);
            assert_eq!(codes(&out), vec!["40001"]);
            assert_eq!(out.last(), Some(&z(b'E')));
            assert_eq!(s.status, b'E');
        }
        // The COMMIT reaches the server as ROLLBACK (no chain, nothing after it runs), whose
        // tag becomes the client's error.
        assert_eq!(
            s.on_client(&proto::query(commit)),
            ClientAction::Substitute(proto::query("ROLLBACK"))
        );
        let out: Vec<ServerAction> = [proto::command_complete("ROLLBACK"), z(b'I')]
            .iter()
            .map(|f| s.on_server(f))
            .collect();
        let ServerAction::Replace(e) = &out[0] else {
            panic!("{commit}: {out:?}")
        };
        assert_eq!(proto::error_field(&e.body, b'C').as_deref(), Some("40001"));
        assert!(proto::error_field(&e.body, b'M')
            .unwrap_or_default()
            .contains("failed over"));
        assert_eq!(out[1], ServerAction::Forward);
        assert_eq!(s.status, b'I');
        assert_eq!(sql_of(&s), vec!["SET a.b = 1"], "{commit}");
        // Usable normally afterwards: the next transaction commits as usual.
        q(&mut s, "BEGIN", &["BEGIN"], b'T');
        let out = q(&mut s, "COMMIT", &["COMMIT"], b'I');
        assert_eq!(tags(&out), vec!["COMMIT"]);
        assert!(codes(&out).is_empty());
    }

    #[test]
    fn commit_of_a_transaction_failover_aborted_fails_with_40001_simple_protocol() {
        for c in [
            "COMMIT",
            "end;",
            "COMMIT AND CHAIN",
            "PREPARE TRANSACTION 'x'",
            "commit; select 1",
        ] {
            commit_after_failover_fails(c, false);
            commit_after_failover_fails(c, true);
        }
        // ROLLBACK stays a plain ROLLBACK.
        let mut s = SessionState::new(vec![]);
        q(&mut s, "BEGIN", &["BEGIN"], b'T');
        s.block_aborted_by_failover(false);
        let out = q(&mut s, "ROLLBACK", &["ROLLBACK"], b'I');
        assert_eq!(tags(&out), vec!["ROLLBACK"]);
        // Any other first statement: 40001 (simple protocol answered, extended skipped to Sync).
        q(&mut s, "BEGIN", &["BEGIN"], b'T');
        s.block_aborted_by_failover(false);
        match s.on_client(&parse("", "SELECT 1")) {
            ClientAction::Reply {
                frames,
                skip_to_sync,
            } => {
                assert!(skip_to_sync);
                assert_eq!(codes(&frames), vec!["40001"]);
            }
            a => panic!("{a:?}"),
        }
    }

    #[test]
    fn lost_commit_pipelined_behind_another_request_still_fails() {
        let mut s = SessionState::new(vec![]);
        q(&mut s, "BEGIN", &["BEGIN"], b'T');
        s.block_aborted_by_failover(true);
        s.status = b'E';
        // A query and a COMMIT sent before the first answer arrives.
        assert_eq!(s.on_client(&proto::query("SELECT 1")), PLAIN);
        assert_eq!(
            s.on_client(&proto::query("COMMIT")),
            ClientAction::Substitute(proto::query("ROLLBACK"))
        );
        let server = [
            proto::error_response("ERROR", "25P02", "aborted"),
            z(b'E'),
            proto::command_complete("ROLLBACK"),
            z(b'I'),
        ];
        let out: Vec<ServerAction> = server.iter().map(|f| s.on_server(f)).collect();
        assert!(
            matches!(&out[2], ServerAction::Replace(e) if e.tag == b'E'),
            "{out:?}"
        );
        assert!(s.idle() && s.status == b'I');
    }

    #[test]
    fn commit_of_a_transaction_failover_aborted_fails_with_40001_extended_protocol() {
        for name in ["", "commit_stmt"] {
            let mut s = SessionState::new(vec![]);
            q(&mut s, "BEGIN", &["BEGIN"], b'T');
            q(&mut s, "INSERT INTO t VALUES (1)", &["INSERT 0 1"], b'T');
            s.block_aborted_by_failover(false);
            // Parse/Bind/Execute/Sync of COMMIT (pgJDBC's commit()): forwarded untouched
            // (no txid query, nothing held).
            assert_eq!(s.on_client(&parse(name, "COMMIT")), PLAIN);
            let mut b = Vec::new();
            proto::put_cstr(&mut b, "");
            proto::put_cstr(&mut b, name);
            b.extend([0, 0, 0, 0, 0, 0]);
            assert_eq!(s.on_client(&Frame::new(b'B', b)), PLAIN);
            assert_eq!(s.on_client(&Frame::new(b'E', vec![0, 0, 0, 0, 0])), PLAIN);
            assert_eq!(s.on_client(&Frame::new(b'S', vec![])), PLAIN);
            let server = [
                Frame::new(b'1', vec![]),
                Frame::new(b'2', vec![]),
                proto::command_complete("ROLLBACK"),
                z(b'I'),
            ];
            let out: Vec<ServerAction> = server.iter().map(|f| s.on_server(f)).collect();
            let ServerAction::Replace(e) = &out[2] else {
                panic!("{out:?}")
            };
            assert_eq!(proto::error_field(&e.body, b'C').as_deref(), Some("40001"));
            assert_eq!(out[3], ServerAction::Forward);
            assert_eq!(s.status, b'I');
            assert!(s.idle());
            // The next transaction commits normally.
            q(&mut s, "BEGIN", &["BEGIN"], b'T');
            assert!(codes(&q(&mut s, "COMMIT", &["COMMIT"], b'I')).is_empty());
        }
    }
}

//! The etcd backend: the [`Store`] trait on an etcd v3 cluster, through the `etcd-client` gRPC
//! crate.
//!
//! - Every key lives under the configured prefix (one etcd can serve several pliant clusters);
//!   the trait's keys and watch events never show it.
//! - Revisions are etcd's own (`header.revision`, `mod_revision`), so compare-and-swap is an etcd
//!   transaction comparing `mod_revision` (0 for an absent key, as etcd compares a missing key
//!   against zero values) and a watch starts at `since + 1` on the server.
//! - Each call is bounded by the request timeout; a timeout or a transport failure is
//!   [`StoreError::Unavailable`], so a controller whose etcd is gone changes nothing and says why.
//! - A watch is an etcd watch stream pumped by a task on the store's runtime. If etcd goes away
//!   the task reopens the stream from the revision after the last event it delivered (etcd keeps
//!   the history until compaction), so a watcher sees every change exactly once; a compacted
//!   start ends the watch with [`StoreError::Compacted`].
//!
//! `etcd-client` is async; the store owns a one-worker tokio runtime so the controller (plain
//! threads) calls it synchronously and watch streams progress in the background.

use crate::{check_key, watch_channel, Event, Result, Store, StoreError, Versioned, Watch};
use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, EventType, GetOptions, ResponseHeader, Txn, TxnOp,
    TxnOpResponse, WatchOptions,
};
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Largest value written to etcd. etcd refuses requests above `--max-request-bytes` (1.5 MiB by
/// default); 1 MiB leaves room for the key and the transaction around it.
pub const MAX_VALUE_BYTES: usize = 1 << 20;
/// Keys one listing returns at most (the controller's keyspace is a few hundred keys).
pub const MAX_LIST: i64 = crate::MAX_KEYS as i64;
const BACKEND: &str = "etcd";

/// TLS towards etcd: the CA that signed etcd's server certificate, and this client's
/// certificate and key (etcd run with `--client-cert-auth` serves only clients its CA signed).
#[derive(Clone, Debug, PartialEq)]
pub struct EtcdTls {
    pub ca: std::path::PathBuf,
    pub cert: std::path::PathBuf,
    /// Read only if mode 0600 (or stricter) and owned by this user.
    pub key: std::path::PathBuf,
}

/// Where the cluster is and how long to wait for it.
#[derive(Clone, Debug, PartialEq)]
pub struct EtcdOptions {
    /// Client URLs, e.g. `http://10.0.0.5:2379`.
    pub endpoints: Vec<String>,
    /// Prefix of every key, ending in `/` (one etcd may hold several pliant clusters).
    pub prefix: String,
    /// Bound on establishing a connection to an endpoint.
    pub connect_timeout: Duration,
    /// Bound on each request (a LAN round trip plus an etcd commit, with margin).
    pub request_timeout: Duration,
    /// Mutual TLS (endpoints must then be `https://`); `None`: plain HTTP/2.
    pub tls: Option<EtcdTls>,
}

impl EtcdOptions {
    pub fn new(endpoints: Vec<String>, prefix: &str) -> EtcdOptions {
        EtcdOptions {
            endpoints,
            prefix: prefix.to_string(),
            connect_timeout: Duration::from_secs(2),
            request_timeout: Duration::from_secs(2),
            tls: None,
        }
    }
}

/// A [`Store`] on etcd (see the module doc).
pub struct EtcdStore {
    rt: tokio::runtime::Runtime,
    client: Client,
    prefix: String,
    timeout: Duration,
    /// Highest etcd revision seen in any answer.
    revision: AtomicU64,
    /// Writes are fenced by this leadership term: (leader key, term). See
    /// [`EtcdStore::fence_writes`].
    fence: Option<(String, u64)>,
}

fn unavailable(reason: String) -> StoreError {
    StoreError::Unavailable {
        backend: BACKEND,
        reason,
    }
}

/// Transport trouble and "no leader / deadline" answers are unavailability; anything else is
/// etcd refusing the request.
pub(crate) fn map_err(e: etcd_client::Error) -> StoreError {
    use etcd_client::Error as E;
    match e {
        E::TransportError(_) | E::IoError(_) => unavailable(e.to_string()),
        E::GRpcStatus(ref s)
            if matches!(
                s.code(),
                tonic_code::Unavailable | tonic_code::DeadlineExceeded | tonic_code::Cancelled
            ) =>
        {
            unavailable(e.to_string())
        }
        // A connection broken under a request surfaces as "Unknown" with the transport error
        // as its source (a broken pipe when etcd died mid-call).
        E::GRpcStatus(ref s)
            if s.code() == tonic_code::Unknown && std::error::Error::source(s).is_some() =>
        {
            unavailable(e.to_string())
        }
        other => StoreError::Backend {
            backend: BACKEND,
            reason: other.to_string(),
        },
    }
}

use tonic::Code as tonic_code;

fn utf8(bytes: &[u8], what: &str) -> Result<String> {
    String::from_utf8(bytes.to_vec()).map_err(|_| StoreError::Backend {
        backend: BACKEND,
        reason: format!("{what} is not UTF-8"),
    })
}

impl EtcdStore {
    /// Builds the client. etcd is not contacted here (connections are made on first use), so a
    /// controller can start while etcd is down and report it; call [`Store::health`] to check.
    pub fn connect(o: &EtcdOptions) -> Result<EtcdStore> {
        if o.endpoints.is_empty() {
            return Err(StoreError::Backend {
                backend: BACKEND,
                reason: "no endpoints configured".into(),
            });
        }
        if o.prefix.is_empty() || !o.prefix.ends_with('/') {
            return Err(StoreError::Backend {
                backend: BACKEND,
                reason: format!("prefix {:?} must be non-empty and end with '/'", o.prefix),
            });
        }
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("pliant-etcd")
            .enable_all()
            .build()
            .map_err(|e| StoreError::Backend {
                backend: BACKEND,
                reason: format!("runtime: {e}"),
            })?;
        let mut opts = ConnectOptions::new();
        if let Some(t) = &o.tls {
            let read = |p: &std::path::Path, private: bool| {
                let r = if private {
                    pliant_wire::keyfile::read_private_text(p)
                } else {
                    pliant_wire::keyfile::read_public_text(p)
                };
                r.map_err(|e| StoreError::Backend {
                    backend: BACKEND,
                    reason: format!("TLS file {}: {e}", p.display()),
                })
            };
            let (ca, cert, key) = (
                read(&t.ca, false)?,
                read(&t.cert, false)?,
                read(&t.key, true)?,
            );
            opts = opts.with_tls(
                etcd_client::TlsOptions::new()
                    .ca_certificate(etcd_client::Certificate::from_pem(ca))
                    .identity(etcd_client::Identity::from_pem(cert, key)),
            );
        }
        let opts = opts
            .with_connect_timeout(o.connect_timeout)
            .with_timeout(o.request_timeout)
            // Detects a silently dead connection (host gone) while a watch is idle.
            .with_keep_alive(Duration::from_secs(2), o.request_timeout)
            .with_keep_alive_while_idle(true);
        let client = rt
            .block_on(Client::connect(&o.endpoints, Some(opts)))
            .map_err(map_err)?;
        Ok(EtcdStore {
            rt,
            client,
            prefix: o.prefix.clone(),
            timeout: o.request_timeout,
            revision: AtomicU64::new(0),
            fence: None,
        })
    }

    /// From now on every write (put, delete, compare-and-swap) succeeds only while the leader
    /// key was created at revision `term`, i.e. while this leadership lasts; otherwise it is
    /// refused by etcd as [`StoreError::Deposed`].
    pub fn fence_writes(&mut self, term: u64) {
        self.fence = Some((
            format!("{}{}", self.prefix, crate::leader::LEADER_KEY),
            term,
        ));
    }

    fn fence_compare(&self) -> Vec<Compare> {
        self.fence
            .iter()
            .map(|(k, t)| Compare::create_revision(k.clone(), CompareOp::Equal, *t as i64))
            .collect()
    }

    /// The read that shows who leads, last in a fenced transaction's failure branch.
    fn fence_reads(&self) -> Vec<TxnOp> {
        self.fence
            .iter()
            .map(|(k, _)| TxnOp::get(k.clone(), None))
            .collect()
    }

    /// After a fenced transaction failed: [`StoreError::Deposed`] if the fence is what failed
    /// (the last read, of the leader key, shows another creation revision or none).
    fn check_fence(&self, reads: &[TxnOpResponse]) -> Result<()> {
        let Some((_, term)) = &self.fence else {
            return Ok(());
        };
        if let Some(TxnOpResponse::Get(g)) = reads.last() {
            let now = g
                .kvs()
                .first()
                .map_or(0, |kv| kv.create_revision().max(0) as u64);
            if now != *term {
                return Err(StoreError::Deposed {
                    term: *term,
                    current: now,
                });
            }
        }
        Ok(())
    }

    /// `op` applied only while the fence holds: the new revision and the answer, or
    /// [`StoreError::Deposed`].
    fn fenced(&self, op: TxnOp) -> Result<(u64, etcd_client::TxnResponse)> {
        let txn = Txn::new()
            .when(self.fence_compare())
            .and_then(vec![op])
            .or_else(self.fence_reads());
        let resp = self.call(|mut c| async move { c.txn(txn).await })?;
        let rev = self.saw(resp.header());
        if !resp.succeeded() {
            // Only the fence can fail this transaction.
            self.check_fence(&resp.op_responses())?;
            return Err(StoreError::Backend {
                backend: BACKEND,
                reason: "fenced write not applied".into(),
            });
        }
        Ok((rev, resp))
    }

    pub(crate) fn prefix(&self) -> &str {
        &self.prefix
    }

    pub(crate) fn client(&self) -> Client {
        self.client.clone()
    }

    pub(crate) fn spawn(&self, f: impl Future<Output = ()> + Send + 'static) {
        self.rt.spawn(f);
    }

    fn full(&self, key: &str) -> Result<String> {
        check_key(key)?;
        Ok(format!("{}{key}", self.prefix))
    }

    fn strip<'a>(&self, full: &'a str) -> &'a str {
        full.strip_prefix(self.prefix.as_str()).unwrap_or(full)
    }

    /// Runs one request on the runtime, bounded by the request timeout.
    pub(crate) fn call<T, F>(&self, f: impl FnOnce(Client) -> F) -> Result<T>
    where
        F: Future<Output = std::result::Result<T, etcd_client::Error>>,
    {
        let fut = f(self.client.clone());
        let ms = self.timeout.as_millis();
        match self
            .rt
            .block_on(async { tokio::time::timeout(self.timeout, fut).await })
        {
            Ok(r) => r.map_err(map_err),
            Err(_) => Err(unavailable(format!("no answer within {ms} ms"))),
        }
    }

    fn saw(&self, h: Option<&ResponseHeader>) -> u64 {
        let r = h.map_or(0, |h| h.revision().max(0) as u64);
        self.revision.fetch_max(r, Ordering::Relaxed);
        r
    }

    /// Compacts etcd's history up to `revision` (what an operator's auto-compaction does): a
    /// watch from before it then ends with [`StoreError::Compacted`].
    pub fn compact(&self, revision: u64) -> Result<()> {
        self.call(|mut c| async move { c.compact(revision as i64, None).await })
            .map(|_| ())
    }
}

impl Store for EtcdStore {
    fn backend(&self) -> &'static str {
        BACKEND
    }

    fn get(&self, key: &str) -> Result<Option<Versioned>> {
        let full = self.full(key)?;
        let resp = self.call(|mut c| async move { c.get(full, None).await })?;
        self.saw(resp.header());
        match resp.kvs().first() {
            None => Ok(None),
            Some(kv) => Ok(Some(Versioned {
                value: utf8(kv.value(), key)?,
                mod_revision: kv.mod_revision().max(0) as u64,
            })),
        }
    }

    fn put(&mut self, key: &str, value: &str) -> Result<u64> {
        let full = self.full(key)?;
        check_value(key, value)?;
        if self.fence.is_some() {
            return self
                .fenced(TxnOp::put(full, value, None))
                .map(|(rev, _)| rev);
        }
        let value = value.to_string();
        let resp = self.call(|mut c| async move { c.put(full, value, None).await })?;
        Ok(self.saw(resp.header()))
    }

    fn delete(&mut self, key: &str) -> Result<Option<u64>> {
        let full = self.full(key)?;
        if self.fence.is_some() {
            let (rev, resp) = self.fenced(TxnOp::delete(full, None))?;
            let deleted = resp
                .op_responses()
                .into_iter()
                .any(|r| matches!(r, TxnOpResponse::Delete(d) if d.deleted() > 0));
            return Ok(deleted.then_some(rev));
        }
        let resp = self.call(|mut c| async move { c.delete(full, None).await })?;
        let rev = self.saw(resp.header());
        Ok((resp.deleted() > 0).then_some(rev))
    }

    fn list(&self, prefix: &str) -> Result<Vec<(String, Versioned)>> {
        let full = format!("{}{prefix}", self.prefix);
        // Sorted by key ascending is etcd's default order for a range.
        let opts = GetOptions::new().with_prefix().with_limit(MAX_LIST);
        let resp = self.call(|mut c| async move { c.get(full, Some(opts)).await })?;
        self.saw(resp.header());
        let mut out = Vec::with_capacity(resp.kvs().len());
        for kv in resp.kvs() {
            let k = utf8(kv.key(), "key")?;
            let key = self.strip(&k).to_string();
            out.push((
                key.clone(),
                Versioned {
                    value: utf8(kv.value(), &key)?,
                    mod_revision: kv.mod_revision().max(0) as u64,
                },
            ));
        }
        Ok(out)
    }

    fn compare_and_swap(
        &mut self,
        key: &str,
        expected: u64,
        value: &str,
    ) -> Result<std::result::Result<u64, u64>> {
        let full = self.full(key)?;
        check_value(key, value)?;
        let mut when = vec![Compare::mod_revision(
            full.clone(),
            CompareOp::Equal,
            expected as i64,
        )];
        when.extend(self.fence_compare());
        // The key's own read comes first: `current` below is the first Get.
        let mut otherwise = vec![TxnOp::get(full.clone(), None)];
        otherwise.extend(self.fence_reads());
        let txn = Txn::new()
            .when(when)
            .and_then(vec![TxnOp::put(full.clone(), value, None)])
            .or_else(otherwise);
        let resp = self.call(|mut c| async move { c.txn(txn).await })?;
        let rev = self.saw(resp.header());
        if resp.succeeded() {
            return Ok(Ok(rev));
        }
        let reads = resp.op_responses();
        self.check_fence(&reads)?;
        let current = reads
            .into_iter()
            .find_map(|r| match r {
                TxnOpResponse::Get(g) => Some(g.kvs().first().map_or(0, |kv| kv.mod_revision())),
                _ => None,
            })
            .unwrap_or(0);
        Ok(Err(current.max(0) as u64))
    }

    fn watch(&self, prefix: &str, since: u64) -> Result<Watch> {
        let (tx, watch) = watch_channel();
        let full = format!("{}{prefix}", self.prefix);
        let strip = self.prefix.len();
        let client = self.client.clone();
        self.rt.spawn(pump(client, full, strip, since, tx));
        Ok(watch)
    }

    fn revision(&self) -> u64 {
        self.revision.load(Ordering::Relaxed)
    }

    fn health(&self) -> Result<u64> {
        let resp = self.call(|mut c| async move { c.status().await })?;
        Ok(self.saw(resp.header()))
    }
}

fn check_value(key: &str, value: &str) -> Result<()> {
    if value.len() > MAX_VALUE_BYTES {
        return Err(StoreError::TooLarge {
            key: key.to_string(),
            len: value.len(),
            max: MAX_VALUE_BYTES,
        });
    }
    Ok(())
}

/// How often the pump looks whether its watcher is gone while nothing changes, and how long it
/// waits before reopening a broken stream.
const PUMP_TICK: Duration = Duration::from_millis(250);

/// Feeds one [`Watch`] from etcd watch streams, reopening after failures from the revision
/// after the last delivered event (see the module doc).
async fn pump(
    client: Client,
    full_prefix: String,
    strip: usize,
    since: u64,
    tx: crate::WatchSender,
) {
    let mut next = since + 1;
    loop {
        if tx.is_closed() {
            return;
        }
        let mut c = client.clone();
        let opts = WatchOptions::new()
            .with_prefix()
            .with_start_revision(next as i64);
        let mut stream = match c.watch(full_prefix.clone(), Some(opts)).await {
            Ok(s) => s,
            Err(_) => {
                tokio::time::sleep(PUMP_TICK).await;
                continue;
            }
        };
        loop {
            let msg = match tokio::time::timeout(PUMP_TICK, stream.message()).await {
                Err(_) => {
                    if tx.is_closed() {
                        return;
                    }
                    continue;
                }
                Ok(m) => m,
            };
            let resp = match msg {
                Ok(Some(r)) => r,
                // Stream ended or failed (etcd restarted, connection lost): reopen.
                Ok(None) | Err(_) => break,
            };
            if resp.compact_revision() > 0 {
                tx.send(Err(StoreError::Compacted {
                    asked: next - 1,
                    oldest: resp.compact_revision() as u64,
                }));
                return;
            }
            if resp.canceled() {
                break;
            }
            for ev in resp.events() {
                let Some(kv) = ev.kv() else { continue };
                let Ok(key) = std::str::from_utf8(kv.key()) else {
                    continue;
                };
                let revision = kv.mod_revision().max(0) as u64;
                let value = match ev.event_type() {
                    EventType::Put => match std::str::from_utf8(kv.value()) {
                        Ok(v) => Some(v.to_string()),
                        Err(_) => continue,
                    },
                    EventType::Delete => None,
                };
                let item = Event {
                    key: key.get(strip..).unwrap_or(key).to_string(),
                    value,
                    revision,
                };
                if !tx.send(Ok(item)) {
                    return;
                }
                next = next.max(revision + 1);
            }
        }
        tokio::time::sleep(PUMP_TICK).await;
    }
}

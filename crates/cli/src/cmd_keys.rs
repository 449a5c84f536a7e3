//! `pliant keys`: the identities every channel between pliant processes authenticates with
//! (pliant-wire: a CA-signed certificate per node naming it and its roles).
//!
//! - `pliant keys ca --dir DIR`: a new deployment CA, `DIR/ca.key` (mode 0600) and `DIR/ca.pub`.
//!   The CA key signs identities; keep it where nodes are provisioned, never on a replica.
//! - `pliant keys issue --ca DIR --name NAME --role ROLE [--role ...] --out DIR [--days N]`: a
//!   node identity directory, `node.key` (0600), `node.cert` and `ca.pub`, which a replica's
//!   `[security] identity` or `pliant hub --identity` names.
//!
//! Nothing is ever overwritten: a CA replaced would leave every identity it issued unverifiable,
//! and a node key replaced under a running node would lock it out at its next connection.

use clap::{Args, Subcommand, ValueEnum};
use pliant_wire::{role, Ca};
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};

#[derive(Args, Debug)]
pub struct KeysArgs {
    #[command(subcommand)]
    pub cmd: KeysCmd,
}

#[derive(Subcommand, Debug)]
pub enum KeysCmd {
    /// Create the deployment's CA: DIR/ca.key (mode 0600; keep it off the replicas) and
    /// DIR/ca.pub. Refuses if either exists.
    Ca(CaArgs),
    /// Issue a node identity signed by the CA: OUT/node.key (0600), OUT/node.cert, OUT/ca.pub.
    /// Refuses if OUT already holds an identity.
    Issue(IssueArgs),
}

#[derive(Args, Debug)]
pub struct CaArgs {
    /// Directory for ca.key and ca.pub (created mode 0700 if missing).
    #[arg(long)]
    pub dir: PathBuf,
}

#[derive(Args, Debug)]
pub struct IssueArgs {
    /// The CA's directory (its ca.key signs the certificate).
    #[arg(long)]
    pub ca: PathBuf,
    /// The node's name: a replica's `[replica] name` (the hub and the replication and
    /// migration channels accept a replica only as the name its certificate carries).
    #[arg(long)]
    pub name: String,
    /// A role the certificate grants (repeat for several): replica (NF replicas), service
    /// (the coherence hub, an FTMB logger service), controller, admin (an operator's CLI),
    /// agent (a host agent).
    #[arg(long = "role", value_enum, required = true)]
    pub roles: Vec<Role>,
    /// Directory for the identity (created mode 0700 if missing).
    #[arg(long)]
    pub out: PathBuf,
    /// Days the certificate is valid (1..=36500).
    #[arg(long, default_value_t = 365)]
    pub days: u64,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    Replica,
    Service,
    Controller,
    Admin,
    Agent,
}

impl Role {
    fn bits(self) -> u32 {
        match self {
            Role::Replica => role::REPLICA,
            Role::Service => role::SERVICE,
            Role::Controller => role::CONTROLLER,
            Role::Admin => role::ADMIN,
            Role::Agent => role::AGENT,
        }
    }
}

pub fn run(a: KeysArgs) -> Result<(), String> {
    match a.cmd {
        KeysCmd::Ca(a) => ca(a),
        KeysCmd::Issue(a) => issue(a),
    }
}

/// Creates `dir` (and its parents) mode 0700 if it does not exist: key directories are
/// nobody else's business, even where the files in them are public.
fn private_dir(dir: &Path) -> Result<(), String> {
    if dir.is_dir() {
        return Ok(());
    }
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|e| format!("cannot create {}: {e}", dir.display()))
}

/// Refuses if any of `files` exists in `dir`, naming them.
fn refuse_existing(dir: &Path, files: &[&str], what: &str) -> Result<(), String> {
    let present: Vec<&str> = files
        .iter()
        .copied()
        .filter(|f| dir.join(f).exists())
        .collect();
    if present.is_empty() {
        return Ok(());
    }
    Err(format!(
        "{} already holds {what} ({}): refusing to overwrite it (remove it first if it really \
         is to be replaced)",
        dir.display(),
        present.join(", ")
    ))
}

fn ca(a: CaArgs) -> Result<(), String> {
    // Checked before anything is written, so a half-present CA is never half-replaced.
    refuse_existing(&a.dir, &["ca.key", "ca.pub"], "a CA")?;
    private_dir(&a.dir)?;
    Ca::generate(Some(&a.dir)).map_err(|e| format!("CA in {}: {e}", a.dir.display()))?;
    println!(
        "created CA in {}: ca.key (mode 0600: keep it where nodes are provisioned, never on a \
         replica), ca.pub",
        a.dir.display()
    );
    Ok(())
}

fn issue(a: IssueArgs) -> Result<(), String> {
    const MAX_DAYS: u64 = 36_500;
    if a.days == 0 || a.days > MAX_DAYS {
        return Err(format!("--days {}: must be 1..={MAX_DAYS}", a.days));
    }
    refuse_existing(&a.out, &["node.key", "node.cert", "ca.pub"], "an identity")?;
    if !a.ca.join("ca.key").exists() {
        return Err(format!(
            "{} holds no ca.key (create a CA with `pliant keys ca --dir {}`)",
            a.ca.display(),
            a.ca.display()
        ));
    }
    let ca = Ca::load(&a.ca).map_err(|e| format!("CA in {}: {e}", a.ca.display()))?;
    let roles = a.roles.iter().fold(0, |r, x| r | x.bits());
    let created = !a.out.exists();
    private_dir(&a.out)?;
    let id = ca
        .issue_to(&a.out, &a.name, roles, a.days * 24 * 3600)
        .map_err(|e| {
            if created {
                // Only if still empty (remove_dir refuses otherwise): a refused name leaves
                // nothing behind.
                let _ = std::fs::remove_dir(&a.out);
            }
            format!("identity {:?} in {}: {e}", a.name, a.out.display())
        })?;
    let names: Vec<String> = a
        .roles
        .iter()
        .filter_map(|r| r.to_possible_value().map(|v| v.get_name().to_string()))
        .collect();
    println!(
        "issued {:?} (roles {}) valid for {} days in {}: node.key (mode 0600), node.cert, ca.pub",
        id.name(),
        names.join(", "),
        a.days,
        a.out.display()
    );
    Ok(())
}

//! How the CLI prints the API's answers: aligned columns, every untrusted value with control
//! characters escaped ([`shared::display::escape_control`]) so no answer can drive the terminal.

use serde_json::Value;
use shared::display::escape_control as esc;
use std::io::Write;

/// A value of `v` as printable text.
fn s(v: &Value, k: &str) -> String {
    match v.get(k) {
        Some(Value::String(s)) => esc(s).into_owned(),
        Some(Value::Null) | None => String::new(),
        Some(other) => esc(&other.to_string()).into_owned(),
    }
}

/// The rows of a page (`{items, total, next}`), and "N of M" to print under them.
fn page_of(page: &Value) -> (Vec<Value>, String) {
    let rows = page["items"].as_array().cloned().unwrap_or_default();
    let more = if page["next"].is_string() {
        " (more after these)"
    } else {
        ""
    };
    let of = format!("{} of {}{more}", rows.len(), page["total"]);
    (rows, of)
}

/// Prints a page of dead outbox rows, each line starting with the item as `console dead requeue`
/// takes it (`ID:VERSION`), so a line's first word pastes into the command.
pub fn print_dead(page: &Value, out: &mut impl Write) -> std::io::Result<()> {
    writeln!(
        out,
        "{:<49}  {:<24}  {:>8}  last error",
        "item (ID:VERSION)", "event_type", "attempts"
    )?;
    let (rows, of) = page_of(page);
    for r in &rows {
        writeln!(
            out,
            "{:<49}  {:<24}  {:>8}  {}",
            format!("{}:{}", s(r, "id"), s(r, "version")),
            s(r, "event_type"),
            s(r, "attempts"),
            s(r, "last_error")
        )?;
    }
    writeln!(
        out,
        "{of} dead row(s); requeue with: console dead requeue --reason TEXT ITEM ..."
    )
}

/// Prints a page of dead letters, each line starting with the item as `console dlq replay` takes
/// it (`MESSAGE_ID=VERSION`), so a line's first word pastes into the command.
pub fn print_dead_letters(page: &Value, out: &mut impl Write) -> std::io::Result<()> {
    let (rows, of) = page_of(page);
    for r in &rows {
        writeln!(
            out,
            "{}={}  {}  {}: {}",
            s(r, "message_id"),
            s(r, "version"),
            s(r, "event_type"),
            s(r, "kind"),
            s(r, "reason")
        )?;
    }
    writeln!(
        out,
        "{of} dead letter(s); replay with: console dlq replay --consumer NAME --reason TEXT ITEM ..."
    )
}

/// Prints an ordered consumer: its partitions and its stuck aggregates with their versions.
pub fn print_ordered(v: &Value, out: &mut impl Write) -> std::io::Result<()> {
    writeln!(
        out,
        "parked {}  gap waits {}  held {}",
        s(v, "parked"),
        s(v, "gap_waits"),
        s(v, "held")
    )?;
    for p in v["partitions"].as_array().into_iter().flatten() {
        writeln!(
            out,
            "partition {}  owner {}  epoch {}  live {}  aggregates {}  held {}",
            s(p, "partition"),
            s(p, "owner"),
            s(p, "epoch"),
            s(p, "live"),
            s(p, "aggregates"),
            s(p, "held")
        )?;
    }
    let stuck = v["stuck"].as_array().cloned().unwrap_or_default();
    for a in &stuck {
        writeln!(
            out,
            "{} {}/{}  version={}  held {}  attempts {}  since {}  {}",
            s(a, "kind"),
            s(a, "aggregate_type"),
            s(a, "aggregate_id"),
            s(a, "version"),
            s(a, "held"),
            s(a, "attempts"),
            s(a, "since"),
            s(a, "reason")
        )?;
    }
    writeln!(out, "{} stuck aggregate(s)", stuck.len())
}

/// Prints approval requests.
pub fn print_approvals(rows: &Value, out: &mut impl Write) -> std::io::Result<()> {
    let rows = rows.as_array().cloned().unwrap_or_default();
    for r in &rows {
        writeln!(
            out,
            "{}  {}  {} on {}  by {}  version {}  reason: {}",
            s(r, "id"),
            s(r, "status"),
            s(r, "action"),
            s(r, "target"),
            s(r, "requested_by"),
            s(r, "version"),
            s(r, "reason")
        )?;
        let p = &r["process"];
        if p.is_object() {
            writeln!(
                out,
                "    process {} {}, now {}{} at version {}",
                s(p, "kind"),
                s(p, "business_key"),
                s(p, "status"),
                if p["paused"] == Value::Bool(true) {
                    " (paused)"
                } else {
                    ""
                },
                s(p, "version")
            )?;
        }
        for m in crate::money::of_process(&r["process"]) {
            writeln!(out, "    money: {}", m.line())?;
        }
    }
    writeln!(out, "{} request(s)", rows.len())
}

/// Prints a page of processes (`{items, total, next}`), one a line, and how many there are in
/// all.
pub fn print_processes(page: &Value, out: &mut impl Write) -> std::io::Result<()> {
    let rows = page["items"].as_array().cloned().unwrap_or_default();
    for r in &rows {
        writeln!(
            out,
            "{}  {:<14} {}  {}  version {}  {}: {}",
            s(r, "id"),
            s(r, "status"),
            s(r, "kind"),
            s(r, "business_key"),
            s(r, "version"),
            s(r, "last_actor"),
            s(r, "last_reason")
        )?;
    }
    writeln!(
        out,
        "{} of {} process(es){}; details: console process show ID",
        rows.len(),
        page["total"],
        if page["next"].is_string() {
            " (more: narrow the filters)"
        } else {
            ""
        }
    )
}

/// Prints one process: status, steps, last error, history, the actions allowed now.
pub fn print_process(p: &Value, out: &mut impl Write) -> std::io::Result<()> {
    writeln!(
        out,
        "process {} {} {}: {}{} (version {})",
        s(p, "id"),
        s(p, "kind"),
        s(p, "business_key"),
        s(p, "status"),
        if p["paused"] == Value::Bool(true) {
            ", paused"
        } else {
            ""
        },
        s(p, "version")
    )?;
    for m in crate::money::of_process(p) {
        writeln!(out, "money: {}", m.line())?;
    }
    if let Some(e) = p.get("last_error").filter(|e| !e.is_null()) {
        writeln!(
            out,
            "last error: {} at step {} {}: {}",
            s(e, "class"),
            s(e, "step"),
            s(e, "name"),
            s(e, "message")
        )?;
    }
    writeln!(out, "steps:")?;
    for st in p["steps"].as_array().into_iter().flatten() {
        writeln!(
            out,
            "  {:>3} {:<20} {:<12} {:<14} attempts {}/{}  operation {}  {}{}",
            s(st, "seq"),
            s(st, "name"),
            s(st, "role"),
            s(st, "status"),
            s(st, "attempts"),
            s(st, "max_attempts"),
            s(st, "operation_id"),
            s(st, "result_ref"),
            match s(st, "error_class").as_str() {
                "" => String::new(),
                c => format!("  {c}: {}", s(st, "error_message")),
            }
        )?;
    }
    writeln!(out, "history:")?;
    for h in p["history"].as_array().into_iter().flatten() {
        writeln!(
            out,
            "  {}  step {:<3} {} -> {}  {}: {}",
            s(h, "at"),
            s(h, "step_seq"),
            s(h, "from_status"),
            s(h, "to_status"),
            s(h, "actor"),
            s(h, "reason")
        )?;
    }
    for d in p["unknown_outcomes"].as_array().into_iter().flatten() {
        writeln!(
            out,
            "WARNING step {} {}: {} (safe action: {})",
            s(d, "step"),
            s(d, "name"),
            s(d, "warning"),
            match s(d, "safe_action").as_str() {
                "" => "none, check at the remote".to_string(),
                a => a.to_string(),
            }
        )?;
    }
    print_allowed(p, out)
}

/// The actions a process allows now, with the role and what each needs.
fn print_allowed(p: &Value, out: &mut impl Write) -> std::io::Result<()> {
    writeln!(out, "allowed now:")?;
    for a in p["allowed_actions"].as_array().into_iter().flatten() {
        // `said` when the action's flag `k` is set.
        let when = |k: &str, said: &'static str| if a[k] == Value::Bool(true) { said } else { "" };
        writeln!(
            out,
            "  {}{}  (role {}{}{}{}{})",
            s(a, "action"),
            match s(a, "step").as_str() {
                "" => String::new(),
                st => format!(" --step {st}"),
            },
            s(a, "min_role"),
            when("needs_approval", ", needs approval"),
            when("needs_evidence", ", needs --evidence"),
            when("needs_remote_check", ", needs --checked and --answer"),
            when("safe_for_unknown_outcome", ", safe for the unknown outcome"),
        )?;
    }
    Ok(())
}

/// Prints an action's answer on one line.
pub fn print_outcome(status: u16, body: &Value, out: &mut impl Write) -> std::io::Result<()> {
    writeln!(out, "{status} {}", esc(&body.to_string()))
}

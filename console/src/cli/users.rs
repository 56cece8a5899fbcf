//! `console user ...`: creating, revoking and listing users, against the database directly (the
//! API needs a user before anyone can call it).

use super::args::UserCommand;
use crate::auth::users;
use anyhow::Context;
use shared::display::escape_control;
use std::io::Write;

/// Runs a user command, printing to `out` (a new user's token last, on a line of its own).
pub async fn run(command: UserCommand, out: &mut impl Write) -> anyhow::Result<()> {
    let db = match &command {
        UserCommand::Create { db, .. }
        | UserCommand::Revoke { db, .. }
        | UserCommand::List { db } => db.clone(),
    };
    let pool = plumbing::db::connect(&db.database_url, 1, "console-user")
        .await
        .context("connecting to PostgreSQL")?;
    plumbing::db::migrate(&pool, &db.schema).await?;
    match command {
        UserCommand::Create {
            name,
            role,
            replace,
            ..
        } => {
            if replace {
                users::revoke(&pool, &db.schema, &name).await?;
            }
            let (user, token) = users::create(&pool, &db.schema, &name, role).await?;
            writeln!(
                out,
                "created user {} ({}) with role {}; its token (shown once):",
                escape_control(&user.name),
                user.id,
                user.role
            )?;
            writeln!(out, "{token}")?;
        }
        UserCommand::Revoke { name, .. } => {
            if !users::revoke(&pool, &db.schema, &name).await? {
                anyhow::bail!("no active user named {}", escape_control(&name));
            }
            writeln!(out, "revoked {}", escape_control(&name))?;
        }
        UserCommand::List { .. } => {
            for u in users::list(&pool, &db.schema).await? {
                writeln!(out, "{}  {:<9} {}", u.id, u.role, escape_control(&u.name))?;
            }
        }
    }
    Ok(())
}

//! Cross-site POSTs are refused, `/login` included, before anything else looks at them.
//!
//! The CSRF token already protects the forms of a session; this also covers the login form (a
//! foreign page could log a victim into the attacker's account) and anything a token would miss.
//! A browser says where a request comes from: `Sec-Fetch-Site` (modern browsers) must be
//! `same-origin` or `none` (typed by the user); without it, `Origin`, when sent, must be the
//! console's own (the scheme and the `Host` the request was sent to). A request with neither header comes from
//! no browser (the CLI, curl, an API client with its bearer token) and passes: those carry no
//! ambient credentials a foreign page could borrow.

use crate::error::ConsoleError;
use axum::extract::Request;
use axum::http::{Method, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

/// Why `request` is cross-site, if it is. A browser sets `Sec-Fetch-Site` itself (no page can),
/// so where it is sent it decides alone; `Origin` is checked for browsers without it.
fn cross_site(request: &Request) -> Option<String> {
    let headers = request.headers();
    if let Some(site) = headers.get("sec-fetch-site") {
        let site = site.to_str().unwrap_or("");
        return (!matches!(site, "same-origin" | "none"))
            .then(|| format!("Sec-Fetch-Site is {site:?}"));
    }
    let origin = headers.get(header::ORIGIN)?;
    let origin = origin.to_str().unwrap_or("");
    let host = headers
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .unwrap_or("");
    let authority = origin
        .strip_prefix("http://")
        .or_else(|| origin.strip_prefix("https://"));
    match authority {
        Some(a) if !host.is_empty() && a.eq_ignore_ascii_case(host) => None,
        _ => Some(format!("Origin {origin:?} is not this console ({host:?})")),
    }
}

/// Middleware: a cross-site POST (or any other unsafe method) is a 403, and does nothing.
pub async fn same_origin_posts(request: Request, next: Next) -> Response {
    let safe = matches!(
        *request.method(),
        Method::GET | Method::HEAD | Method::OPTIONS
    );
    if !safe && let Some(why) = cross_site(&request) {
        tracing::warn!(path = %request.uri().path(), %why, "console refused a cross-site request");
        crate::internal_events::cross_site_refused();
        let e = ConsoleError::Forbidden(format!("cross-site request refused: {why}"));
        // The API answers JSON, the web side its own page.
        return if request.uri().path().starts_with("/api/") {
            e.into_response()
        } else {
            crate::http::pages::error_page(None, &e)
        };
    }
    next.run(request).await
}

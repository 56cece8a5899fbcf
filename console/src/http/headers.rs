//! Security headers on every answer, page or API: the console needs no script, no frame and no
//! foreign resource, so it allows none.
//!
//! - `Content-Security-Policy`: nothing but the console's own stylesheet and forms posting to
//!   itself; no script at all; `frame-ancestors 'none'` (no page may frame the console's forms);
//! - `X-Frame-Options: DENY` for browsers that predate `frame-ancestors`;
//! - `X-Content-Type-Options: nosniff`, `Referrer-Policy: same-origin` (nothing leaves for other
//!   sites; `no-referrer` would make browsers send `Origin: null` on the console's own forms),
//!   `Cross-Origin-Opener-Policy: same-origin`;
//! - `Cache-Control: no-store` on every answer that does not set its own (pages and API answers
//!   carry what a signed-in user may see; only the stylesheet is cacheable).

use axum::extract::Request;
use axum::http::{HeaderName, HeaderValue, header};
use axum::middleware::Next;
use axum::response::Response;

/// The console's content security policy.
pub const CSP: &str = "default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; \
                       frame-ancestors 'none'; base-uri 'none'";

/// Middleware: adds the headers to every response.
pub async fn security_headers(request: Request, next: Next) -> Response {
    let mut response = next.run(request).await;
    let h = response.headers_mut();
    let set = |h: &mut axum::http::HeaderMap, name: HeaderName, value: &'static str| {
        h.insert(name, HeaderValue::from_static(value));
    };
    set(h, header::CONTENT_SECURITY_POLICY, CSP);
    set(h, header::X_FRAME_OPTIONS, "DENY");
    set(h, header::X_CONTENT_TYPE_OPTIONS, "nosniff");
    set(h, header::REFERRER_POLICY, "same-origin");
    set(
        h,
        HeaderName::from_static("cross-origin-opener-policy"),
        "same-origin",
    );
    if !h.contains_key(header::CACHE_CONTROL) {
        set(h, header::CACHE_CONTROL, "no-store");
    }
    response
}

//! `/api/whoami`: who the token belongs to.

use super::Bearer;
use crate::auth::users::Principal;
use axum::Json;

/// Who the token belongs to.
#[utoipa::path(get, path = "/api/whoami", tag = "users", responses((status = 200, body = Principal)))]
pub async fn whoami(Bearer(p): Bearer) -> Json<Principal> {
    Json(p)
}

//! Template names are per tenant: the one rule for what an id or a name
//! means to a caller, and which names a new template may take.
//!
//! - A key (id or name) resolves, for a tenant, to its own template of
//!   that id, or a shared one's (tenant none: the built-in probe, an
//!   admin's); failing that, to its own template of that name, then a
//!   shared one's. Another tenant's template is not there for it, by id
//!   or by name (the caller's answer is the same 404 as for a missing
//!   one). For an admin (and for the service's own calls, no owner) every
//!   template is there: ids, then shared names, then any tenant's name.
//! - A shared template also answers to its short alias, if it has one
//!   ([`SHARED_ALIASES`]: `code-interpreter` for E2B's
//!   `code-interpreter-v1`), after every template really named so.
//! - A deleted template is gone to callers; its row stays for the
//!   sandboxes that named it, read by id by the service's own calls.
//! - A new template's name is unique in its namespace (its tenant's, or
//!   the shared one), and a tenant's may not take a shared template's
//!   name (it would hide that one from its own callers); an admin's shared
//!   template may take a name tenants use (each of them keeps its own).
//!
//! The service resolves over its store's rows of that id or name
//! ([`crate::service::Service::resolve_template`]); `torpor serve` in
//! front of several pods resolves over every pod's list with the same
//! [`rank`], so that its placement picks what the pod will.

use crate::model::{Owner, Template, TemplateState};

/// Whether a template of `tenant` (none: shared) is there for `owner`:
/// shared ones and its own; every one for an admin and for the service's
/// own calls (no owner). What lists keep for a caller too.
pub fn visible(tenant: Option<&str>, owner: Option<&Owner>) -> bool {
    match owner.filter(|o| !o.admin) {
        Some(o) => tenant.is_none_or(|t| t == o.tenant),
        None => true,
    }
}

/// Short aliases of shared templates' names: (alias, name).
pub const SHARED_ALIASES: [(&str, &str); 1] = [("code-interpreter", "code-interpreter-v1")];

/// The shared template name `key` is an alias of, if it is one.
pub fn alias_target(key: &str) -> Option<&'static str> {
    SHARED_ALIASES
        .iter()
        .find(|(alias, _)| *alias == key)
        .map(|(_, name)| *name)
}

/// How well `t` answers `key` for `owner` (none: not at all, or not
/// there for this caller); lower is better: 0 its id, 1 the caller's own
/// name, 2 a shared template's name, 3 a shared template's alias, 4
/// another tenant's name (admins and the service's own calls only).
pub fn rank(t: &Template, owner: Option<&Owner>, key: &str) -> Option<u8> {
    let by_id = t.id.as_str() == key;
    let deleted = t.state == TemplateState::Deleted;
    // A deleted row is read by id by the service's own calls only.
    if deleted && (owner.is_some() || !by_id) {
        return None;
    }
    if !visible(t.tenant.as_deref(), owner) {
        return None;
    }
    let tenant = owner.filter(|o| !o.admin).map(|o| o.tenant.as_str());
    let own = tenant.is_some() && t.tenant.as_deref() == tenant;
    let shared = t.tenant.is_none();
    if by_id {
        Some(0)
    } else if t.name != key {
        (shared && alias_target(key) == Some(t.name.as_str())).then_some(3)
    } else if own {
        Some(1)
    } else if shared {
        Some(2)
    } else {
        Some(4)
    }
}

/// The template `key` names for `owner` among `candidates`: the best
/// [`rank`], then the oldest.
pub fn resolve<'a>(
    candidates: impl IntoIterator<Item = &'a Template>,
    owner: Option<&Owner>,
    key: &str,
) -> Option<&'a Template> {
    candidates
        .into_iter()
        .filter_map(|t| rank(t, owner, key).map(|r| (r, t)))
        .min_by(|(ra, a), (rb, b)| (ra, a.created_at, &a.id).cmp(&(rb, b.created_at, &b.id)))
        .map(|(_, t)| t)
}

/// Why a template of `tenant` (none: shared) may not be named `name`,
/// given the tenants of the live templates already named so (none:
/// shared): `Some((kind, name))` for a 409 "`kind` `name` already exists".
pub fn name_conflict<'a>(
    tenant: Option<&str>,
    name: &str,
    existing: impl IntoIterator<Item = Option<&'a str>>,
) -> Option<(&'static str, String)> {
    let mut shared = false;
    for other in existing {
        if other == tenant {
            return Some(("template named", name.to_string()));
        }
        shared |= other.is_none();
    }
    (tenant.is_some() && shared).then(|| ("shared template named", name.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{TemplateId, TemplateKind, Timestamp};

    fn t(id: &str, name: &str, tenant: Option<&str>, at: i64) -> Template {
        Template {
            id: TemplateId::new(id),
            name: name.into(),
            kernel: "builtin:probe".into(),
            rootfs: None,
            snapshot_dir: None,
            mem_mib: 64,
            vcpus: 1,
            kind: TemplateKind::Probe,
            created_at: Timestamp(at),
            state: TemplateState::Ready,
            tenant: tenant.map(str::to_string),
            image: None,
            source: None,
            stored_snapshot: None,
        }
    }

    fn owner(tenant: &str, admin: bool) -> Owner {
        Owner {
            tenant: tenant.into(),
            admin,
        }
    }

    #[test]
    fn own_then_shared_and_never_another_tenants() {
        let all = [
            t("tpl_evil", "base", Some("evil"), 1),
            t("tpl_shared", "base", None, 2),
            t("tpl_acme", "x", Some("acme"), 3),
            t("tpl_evilx", "x", Some("evil"), 4),
        ];
        let acme = owner("acme", false);
        let evil = owner("evil", false);
        let id = |o: &Owner, key: &str| resolve(&all, Some(o), key).map(|t| t.id.to_string());
        assert_eq!(id(&acme, "base").as_deref(), Some("tpl_shared"));
        assert_eq!(id(&evil, "base").as_deref(), Some("tpl_evil"));
        assert_eq!(id(&acme, "x").as_deref(), Some("tpl_acme"));
        assert_eq!(id(&evil, "x").as_deref(), Some("tpl_evilx"));
        assert_eq!(id(&acme, "tpl_evil"), None);
        assert_eq!(id(&acme, "tpl_shared").as_deref(), Some("tpl_shared"));
        // An admin: shared names first, then the oldest tenant's.
        let admin = owner("admin", true);
        assert_eq!(id(&admin, "base").as_deref(), Some("tpl_shared"));
        assert_eq!(id(&admin, "x").as_deref(), Some("tpl_acme"));
        assert_eq!(id(&admin, "tpl_evil").as_deref(), Some("tpl_evil"));
        // Deleted: gone to callers, read by id by the service itself.
        let mut gone = t("tpl_gone", "old", Some("acme"), 5);
        gone.state = TemplateState::Deleted;
        assert_eq!(rank(&gone, Some(&acme), "tpl_gone"), None);
        assert_eq!(rank(&gone, None, "tpl_gone"), Some(0));
        assert_eq!(rank(&gone, None, "old"), None);
    }

    #[test]
    fn a_shared_template_answers_to_its_alias_after_real_names() {
        let interp = t("tpl_i", "code-interpreter-v1", None, 1);
        let acme = owner("acme", false);
        let id =
            |all: &[Template], key: &str| resolve(all, Some(&acme), key).map(|t| t.id.to_string());
        assert_eq!(
            id(std::slice::from_ref(&interp), "code-interpreter").as_deref(),
            Some("tpl_i")
        );
        assert_eq!(
            id(std::slice::from_ref(&interp), "code-interpreter-v1").as_deref(),
            Some("tpl_i")
        );
        // Only a shared one has it; a template really named so comes first.
        let theirs = t("tpl_e", "code-interpreter-v1", Some("evil"), 0);
        assert_eq!(id(&[theirs], "code-interpreter"), None);
        let own = t("tpl_a", "code-interpreter", Some("acme"), 2);
        assert_eq!(
            id(&[interp.clone(), own], "code-interpreter").as_deref(),
            Some("tpl_a")
        );
        assert_eq!(id(&[interp], "interpreter"), None);
        assert_eq!(
            alias_target("code-interpreter"),
            Some("code-interpreter-v1")
        );
    }

    #[test]
    fn names_conflict_in_their_namespace_and_over_shared_ones() {
        assert!(name_conflict(Some("acme"), "x", [Some("evil")]).is_none());
        assert_eq!(
            name_conflict(Some("acme"), "x", [Some("acme")]).map(|c| c.0),
            Some("template named")
        );
        assert_eq!(
            name_conflict(Some("acme"), "base", [None]).map(|c| c.0),
            Some("shared template named")
        );
        assert!(name_conflict(None, "base", [Some("evil")]).is_none());
        assert!(name_conflict(None, "base", [None]).is_some());
    }
}

//! Properties of scope extraction, through the public API: a scope is a function of the exact
//! bytes of its header, two different values never share one, no header value can forge another
//! source's scope (a credential's included, once hashed), a repeated header is refused, and
//! nothing panics.

use http::request::Parts;
use http::{HeaderName, HeaderValue};
use idem_core::{
    Scope, ScopeError, ScopeSecrets, ScopeSource, UnixMillis,
    protocol::{Caller, CredentialScopes},
    store::{ScopeSalt, StoreIdentity},
};
use proptest::prelude::*;

/// Bytes a header value may hold (no NUL, CR or LF; visible ASCII, space, tab, obs-text).
fn value_bytes() -> impl Strategy<Value = Vec<u8>> {
    let byte = prop_oneof![
        4 => 0x20u8..=0x7e,
        2 => 0x80u8..=0xff,
        1 => Just(b'\t'),
    ];
    prop::collection::vec(byte, 0..48)
}

fn parts<V: AsRef<[u8]>>(name: &str, values: &[V]) -> Parts {
    let mut builder = http::Request::builder();
    for value in values {
        builder = builder.header(
            name,
            HeaderValue::from_bytes(value.as_ref()).expect("a valid header value"),
        );
    }
    builder.body(()).expect("a request").into_parts().0
}

fn user_id() -> ScopeSource {
    ScopeSource::Header(HeaderName::from_static("x-user-id"))
}

/// The stored scope of a request, credentials hashed under a fixed salt.
fn scope_of(source: &ScopeSource, parts: &Parts) -> Result<Scope, ScopeError> {
    let salt = ScopeSalt {
        salt: [7; 32],
        identity: StoreIdentity::from_bytes([7; 16]),
        created_at: UnixMillis::from_i64(1),
        older_records_until: None,
    };
    Ok(match source.caller_of(parts)? {
        Caller::Scope(scope) => scope,
        Caller::Credential(value) => CredentialScopes::new(&salt, &ScopeSecrets::default()).scope(value.as_bytes()),
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn different_header_values_are_different_scopes(a in value_bytes(), b in value_bytes()) {
        // `http` keeps a value's bytes as given; scopes must keep them too.
        let scope_a = scope_of(&user_id(), &parts("x-user-id", &[&a])).unwrap();
        let scope_b = scope_of(&user_id(), &parts("x-user-id", &[&b])).unwrap();
        prop_assert_eq!(a == b, scope_a == scope_b, "{:?} {:?} -> {} {}", a, b, scope_a, scope_b);
    }

    #[test]
    fn a_scope_is_stable_and_survives_its_stored_form(a in value_bytes()) {
        let scope = scope_of(&user_id(), &parts("x-user-id", &[&a])).unwrap();
        prop_assert_eq!(&scope, &scope_of(&user_id(), &parts("x-user-id", &[a])).unwrap());
        prop_assert_eq!(Scope::from_stored(scope.as_str()), scope);
    }

    #[test]
    fn no_header_value_forges_another_sources_scope(a in value_bytes(), id in "[a-z0-9:-]{0,16}") {
        let from_header = scope_of(&user_id(), &parts("x-user-id", &[&a])).unwrap();
        let credential = scope_of(&ScopeSource::Credential, &parts("authorization", &[&a])).unwrap();
        if a.is_empty() {
            // An empty header names nobody.
            prop_assert!(from_header.is_anonymous() && credential.is_anonymous());
        } else {
            for other in [Scope::anonymous(), Scope::shared(), Scope::application(&id), credential.clone()] {
                prop_assert_ne!(&from_header, &other);
            }
            prop_assert_ne!(&credential, &Scope::application(&id));
        }
    }

    #[test]
    fn a_repeated_scope_header_is_always_refused(values in prop::collection::vec(value_bytes(), 2..5)) {
        prop_assert!(scope_of(&user_id(), &parts("x-user-id", &values)).is_err());
        prop_assert!(scope_of(&ScopeSource::Credential, &parts("authorization", &values)).is_err());
        // Other headers do not count.
        prop_assert!(scope_of(&user_id(), &parts("x-other", &values)).unwrap().is_anonymous());
    }
}

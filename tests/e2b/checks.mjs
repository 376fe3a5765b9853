// What the JS SDK scripts share (as checks.py for the Python ones):
// `checks(prefix)` counts the conditions that held and ends the script
// (exit 1) at the first that does not, naming it after `prefix`; `raises`
// checks that a call rejects with an error of a class (and, given
// `contains`, saying it).
export function checks(prefix) {
  let count = 0
  const check = (cond, what) => {
    if (!cond) {
      console.error(`${prefix}: FAILED: ${what}`)
      process.exit(1)
    }
    count += 1
  }
  const raises = async (cls, fn, what, contains) => {
    try {
      await fn()
    } catch (e) {
      check(e instanceof cls, `${what}: raised ${e?.constructor?.name}: ${e?.message}`)
      if (contains !== undefined) {
        check(String(e?.message).includes(contains), `${what}: ${e?.message} says ${contains}`)
      }
      return e
    }
    check(false, `${what}: did not raise ${cls.name}`)
  }
  const passed = () => console.log(`${prefix}: ${count} passed, 0 failed`)
  return { check, raises, passed }
}

from services.critic.service import main

raise SystemExit(main())
